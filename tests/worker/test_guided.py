"""Guided decoding in the engine (worker/engine/guided.py): the grammar masks every sampled
token, the request stops when the grammar is complete, and a decode migrated to another
engine mid-stream rebuilds the matcher by replaying the tokens sampled before it and goes
on exactly as an uninterrupted run."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch
from engine_cases import make_cases, processor, to_request

from triptych.router.structured import schema_grammar
from triptych.sampling_params import SamplingParams
from triptych.topology import InstanceType, Stage
from triptych.worker.engine import Engine, EngineConfig, PrefilledKV, RequestStatus
from triptych.worker.engine.guided import GrammarError, Guide, mask_logits
from triptych.worker.engine.request import FinishReason

SCHEMA = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["word", "n"], "additionalProperties": False}


def _engine(model_dir: Path, role: InstanceType) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), role=role, num_kv_blocks=96, num_mm_blocks=64, mm_block_rows=8))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_guided_run_validates_and_a_migrated_decode_continues_exactly(qwen2_vl_dir: Path, seed: int) -> None:
    proc = processor(qwen2_vl_dir)
    case = make_cases(4)[1]  # one image
    grammar = schema_grammar(SCHEMA, "schema")
    params = SamplingParams(temperature=1.0, seed=seed, max_tokens=60)
    src, dst = _engine(qwen2_vl_dir, InstanceType.EPD), _engine(qwen2_vl_dir, InstanceType.PD)
    (whole,) = _engine(qwen2_vl_dir, InstanceType.EPD).generate_batch(
        [to_request(proc, case, "w", params, grammar=grammar)])
    # The grammar, not EOS or max_tokens, ended it: the text is a complete, valid object.
    assert whole.finish_reason == FinishReason.STOP
    assert whole.output_token_ids[-1] not in proc.eos_token_ids
    jsonschema.validate(json.loads(proc.tokenizer.decode(whole.output_token_ids)), SCHEMA)

    req = to_request(proc, case, "x", params, grammar=grammar)
    src.add_request(req)
    while len(req.output_token_ids) < 4:
        src.step()
    src.offload(migrate=True)
    handoff = next(o.handoff for o in src.step() if o.handoff is not None)
    assert req.status == RequestStatus.PARKED
    ids = dst.reserve_kv(handoff.num_kv_tokens)
    dst.kv.tensor[torch.tensor(ids)] = src.kv.tensor[torch.tensor(handoff.kv_block_ids)]
    cont = to_request(proc, case, "x", params, grammar=grammar, stages={Stage.DECODE},
                      prefilled=PrefilledKV(ids, handoff.num_kv_tokens, handoff.first_token,
                                            generated=list(handoff.generated)))
    cont.images = {}
    dst.generate_batch([cont])
    src.release("x")
    src.step()
    assert cont.guide.consumed == len(cont.output_token_ids)  # replayed, then advanced here
    assert cont.output_token_ids == whole.output_token_ids
    assert cont.finish_reason == FinishReason.STOP


def test_replayed_tokens_the_grammar_refuses_and_bad_grammars_are_refused(qwen2_vl_dir: Path) -> None:
    proc = processor(qwen2_vl_dir)
    engine = _engine(qwen2_vl_dir, InstanceType.PD)
    grammar = schema_grammar(SCHEMA, "schema")
    not_json = proc.encode("hello")[0]  # a JSON object cannot start with it
    case = make_cases(1)[0]
    prompt_len = len(to_request(proc, case, "t").prompt_token_ids)
    ids = engine.reserve_kv(prompt_len)
    req = to_request(proc, case, "r", SamplingParams(max_tokens=8), grammar=grammar, stages={Stage.DECODE},
                     prefilled=PrefilledKV(ids, prompt_len, not_json))
    with pytest.raises(GrammarError, match="not accepted"):
        engine.add_request(req)
    bad = to_request(proc, make_cases(1)[0], "b", SamplingParams(max_tokens=8), grammar='start: nope',
                     stages={Stage.PREFILL, Stage.DECODE})
    with pytest.raises(GrammarError, match="does not compile"):
        engine.add_request(bad)
    assert engine.kv.num_used == 0  # the refused request's blocks were freed


def test_mask_keeps_only_allowed_tokens_on_guided_rows(qwen2_vl_dir: Path) -> None:
    engine = _engine(qwen2_vl_dir, InstanceType.PD)
    guide: Guide = engine.admission.guides.matcher(schema_grammar({"type": "boolean"}, "s"))
    vocab = engine.spec.vocab_size
    logits = torch.randn(2, vocab)
    masked = mask_logits(logits, [None, guide])
    assert torch.equal(masked[0], logits[0])
    allowed = torch.isfinite(masked[1]).nonzero().flatten().tolist()
    proc = processor(qwen2_vl_dir)
    texts = {proc.tokenizer.decode([t]) for t in allowed}
    assert allowed and all("true".startswith(t) or "false".startswith(t) for t in texts), texts


def test_n_choices_each_guided_from_their_own_first_token(qwen2_vl_dir: Path) -> None:
    """n > 1 with a grammar: the prefill's extra first-token rows are masked too (each first
    token is one the grammar allows), and each forked choice decodes under a matcher replayed
    from its own first token (worker/choices.py) exactly what a guided n=1 request with that
    choice's seed does alone; every choice is a valid object."""
    from triptych.sampling_params import choice_seed

    proc = processor(qwen2_vl_dir)
    engine = _engine(qwen2_vl_dir, InstanceType.EPD)
    grammar = schema_grammar(SCHEMA, "schema")
    case = make_cases(1)[0]
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=60, n=3)
    pre = to_request(proc, case, "p", params, grammar=grammar, stages={Stage.PREFILL})
    engine.generate_batch([pre])
    firsts = [pre.handoff.first_token, *(t for t, _ in pre.choice_firsts)]
    assert len(firsts) == 3
    children = []
    for i, first in enumerate(firsts):
        blocks = engine.fork_kv(pre.handoff.kv_block_ids, pre.handoff.num_kv_tokens)
        child = to_request(proc, case, f"c{i}", params.for_choice(i), grammar=grammar, stages={Stage.DECODE},
                           prefilled=PrefilledKV(blocks, pre.handoff.num_kv_tokens, first))
        child.images = {}
        child.guide = engine.admission.guides.matcher(grammar, [first])  # raises if the mask was skipped
        children.append(child)
    engine.release("p")
    engine.generate_batch(children)
    alone = [to_request(proc, case, f"a{i}", params.model_copy(update={"n": 1, "seed": choice_seed(11, i)}),
                        grammar=grammar) for i in range(3)]
    engine.generate_batch(alone)
    for child, single, first in zip(children, alone, firsts, strict=True):
        assert child.output_token_ids[0] == first and child.output_token_ids == single.output_token_ids
        jsonschema.validate(json.loads(proc.tokenizer.decode(single.output_token_ids)), SCHEMA)
    assert len({tuple(c.output_token_ids) for c in children}) > 1  # the seed streams differ
    assert engine.kv.num_used == 0
