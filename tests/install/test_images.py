"""The container images, built for real: the CPU worker image and the slim operator image from a
local Debian bookworm base (no registry is reachable; tools/build-base-image.sh makes it with
debootstrap), then the worker image serving the tiny model and the router from the operator image
in front of it (host networking, loopback only), answering a chat request with an image.

Marked `docker`: skipped with a reason when no Docker daemon is reachable."""

from __future__ import annotations

import base64
import io
import json
import os
import secrets
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from PIL import Image
from polling import wait_until

from triptych.http_ready import answers_ok
from triptych.local import free_port
from triptych.operator.crd import render_crd

ROOT = Path(__file__).resolve().parents[2]
BASE_IMAGE = os.environ.get("TRIPTYCH_BASE_IMAGE", "triptych-base:bookworm")
WORKER_TAG = "triptych-worker:test-cpu"
OPERATOR_TAG = "triptych-operator:test"
CONTEXT_ITEMS = ("pyproject.toml", "setup.py", "README.md", ".dockerignore", "Dockerfile.worker",
                 "Dockerfile.operator", "triptych", "worker", "router", "operator", "tools/requirements")

# Cold builds take many minutes (pip installs torch, NIXL, transformers); warm ones reuse layers.
pytestmark = [pytest.mark.docker, pytest.mark.timeout(3600)]


def _docker_ok() -> str | None:
    if shutil.which("docker") is None:
        return "needs docker (tools/install-test-deps.sh installs docker.io and starts dockerd)"
    info = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=30)
    if info.returncode != 0:
        return f"no reachable Docker daemon ({info.stderr.strip().splitlines()[-1] if info.stderr else 'docker info failed'})"
    return None


def docker(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check:
        assert out.returncode == 0, f"docker {' '.join(args[:3])}...: {out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def _ensure_base_image() -> None:
    if docker("image", "inspect", BASE_IMAGE, check=False).returncode == 0:
        return
    # Imports the cached root filesystem (seconds) or runs debootstrap (a few minutes).
    out = subprocess.run([str(ROOT / "tools" / "build-base-image.sh"), BASE_IMAGE], capture_output=True,
                         text=True, timeout=1200)
    if out.returncode != 0:
        pytest.skip(f"no local base image {BASE_IMAGE}: tools/build-base-image.sh failed: {out.stderr[-500:]}")


def _torch_wheel() -> Path | None:
    """The CPU torch wheel in pip's find-links folder, if this machine has one."""
    links = os.environ.get("PIP_FIND_LINKS") or subprocess.run(
        ["pip", "config", "get", "global.find-links"], capture_output=True, text=True).stdout.strip()
    for folder in filter(None, (links or "").split()):
        found = sorted(Path(folder).glob("torch-2.13.0+cpu-cp311-*.whl"))
        if found:
            return found[0]
    return None


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, dict]]:
    reason = _docker_ok()
    if reason:
        pytest.skip(reason)
    _ensure_base_image()
    context = tmp_path_factory.mktemp("context")
    for item in CONTEXT_ITEMS:
        src, dst = ROOT / item, context / item
        if src.is_dir():
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(src, dst)
    build_args = ["--build-arg", f"CPU_BASE_IMAGE={BASE_IMAGE}", "--build-arg", f"CUDA_BASE_IMAGE={BASE_IMAGE}"]
    wheel = _torch_wheel()
    if wheel is not None:  # bring the CPU wheel rather than fetching (PyTorch's index may be unreachable)
        (context / "wheels").mkdir()
        shutil.copy2(wheel, context / "wheels" / wheel.name)
        build_args += ["--build-arg", "TORCH_CPU_INDEX="]
    def build(tag: str, dockerfile: str, args: list[str]) -> dict:
        start = time.monotonic()
        docker("build", "--network", "host", "-f", dockerfile, "-t", tag, *args, str(context), timeout=2400)
        inspect = json.loads(docker("image", "inspect", tag).stdout)[0]
        return {"build_s": round(time.monotonic() - start, 1), "size_mb": round(inspect["Size"] / 1e6),
                "config": inspect["Config"]}

    # Both at once: a cold build mostly waits on downloads and disk.
    with ThreadPoolExecutor(2) as pool:
        futures = {WORKER_TAG: pool.submit(build, WORKER_TAG, "Dockerfile.worker", build_args),
                   OPERATOR_TAG: pool.submit(build, OPERATOR_TAG, "Dockerfile.operator",
                                             ["--build-arg", f"BASE_IMAGE={BASE_IMAGE}"])}
        report = {tag: future.result() for tag, future in futures.items()}
    print("\nimage build report:", json.dumps({t: {k: v for k, v in r.items() if k != "config"}
                                               for t, r in report.items()}))
    yield report


def test_images_run_unprivileged_with_oci_labels(images: dict[str, dict]) -> None:
    for tag, title in ((WORKER_TAG, "triptych-worker"), (OPERATOR_TAG, "triptych-operator")):
        config = images[tag]["config"]
        assert config["User"] == "1000:1000"
        assert config["Labels"]["org.opencontainers.image.title"] == title
        assert config["Labels"]["org.opencontainers.image.version"] == "0.1.0"
        assert config["Entrypoint"] == ["triptych"]


def test_worker_image_has_the_serving_stack(images: dict[str, dict]) -> None:
    code = "import torch, nixl, av; print(torch.__version__, av.__version__, torch.cuda.is_available())"
    out = docker("run", "--rm", "--network", "host", "--entrypoint", "python", WORKER_TAG, "-c", code).stdout.split()
    assert out == ["2.13.0+cpu", "18.1.0", "False"]
    # The CPU decode kernel, built ahead where the build stage could install a compiler, loads
    # as the image's user without one.
    code = ("import os; from triptych.worker.attention import cpu_decode as c; "
            "print(len(os.listdir(os.environ['TRIPTYCH_KERNEL_DIR'])), c.kernel() is not None)")
    built, loaded = docker("run", "--rm", "--entrypoint", "python", WORKER_TAG, "-c", code).stdout.split()
    assert loaded == str(built != "0"), (built, loaded)


def test_operator_image_has_no_torch_and_prints_the_crd(images: dict[str, dict]) -> None:
    code = ("import importlib.util as u; import triptych.operator.handlers, triptych.router.main; "
            "print([m for m in ('torch', 'transformers') if u.find_spec(m)])")
    assert docker("run", "--rm", "--entrypoint", "python", OPERATOR_TAG, "-c", code).stdout.strip() == "[]"
    assert docker("run", "--rm", OPERATOR_TAG, "crd").stdout == render_crd()
    # `triptych operator` starts: its handlers import and kopf's engine runs until it needs a
    # cluster (there is none: it keeps retrying the login, so the container is removed then).
    name = f"triptych-test-operator-{uuid.uuid4().hex[:8]}"
    docker("run", "-d", "--name", name, "--network", "none", "-e", "KUBECONFIG=/nonexistent", OPERATOR_TAG,
           "operator", "--standalone")
    try:
        deadline, text = time.monotonic() + 90, ""
        while "Initial authentication has been initiated" not in text and time.monotonic() < deadline:
            time.sleep(1)
            logs = docker("logs", name, check=False)
            text = logs.stdout + logs.stderr
        assert "Initial authentication has been initiated" in text, text[-2000:]
        assert "ModuleNotFoundError" not in text and "ImportError" not in text, text[-2000:]
    finally:
        docker("rm", "-f", name, check=False)


def _png_data_url() -> str:
    img = Image.new("RGB", (64, 48), (30, 160, 90))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture
def containers(images: dict[str, dict], tmp_path: Path) -> Iterator[tuple[str, list[str]]]:
    """The worker container (EPD, tiny model built inside it) and the router container in front."""
    models = tmp_path / "models"
    models.mkdir()
    models.chmod(0o777)  # the containers run as uid 1000
    worker_port, router_port = free_port(), free_port()
    suffix = uuid.uuid4().hex[:8]
    names = [f"triptych-test-worker-{suffix}", f"triptych-test-router-{suffix}"]
    token = secrets.token_urlsafe(24)  # the internal plane's token: worker and router share it
    docker("run", "-d", "--name", names[0], "--network", "host", "-v", f"{models}:/models",
           "-e", f"TRIPTYCH_INTERNAL_TOKEN={token}",
           "--entrypoint", "sh", WORKER_TAG, "-c",
           "triptych make-tiny-model --family qwen2-vl --out /models/tiny && "
           f"exec triptych worker --model /models/tiny --role EPD --host 127.0.0.1 --port {worker_port}")
    try:
        deadline = time.monotonic() + 300
        while not (models / "tiny" / "config.json").exists():
            assert time.monotonic() < deadline, docker("logs", names[0], check=False).stderr[-3000:]
            time.sleep(1)
        docker("run", "-d", "--name", names[1], "--network", "host", "-v", f"{models}:/models:ro",
               "-e", f"TRIPTYCH_INTERNAL_TOKEN={token}", OPERATOR_TAG,
               "router", "--model", "/models/tiny", "--workers", f"http://127.0.0.1:{worker_port}",
               "--host", "127.0.0.1", "--port", str(router_port))
        url = f"http://127.0.0.1:{router_port}"
        if not wait_until(lambda: answers_ok(f"{url}/ready"), max(0.0, deadline - time.monotonic()), interval_s=1):
            logs = {n: docker("logs", n, check=False) for n in names}
            raise AssertionError({n: (o.stdout + o.stderr)[-2000:] for n, o in logs.items()})
        yield url, names
    finally:
        for name in names:
            docker("rm", "-f", name, check=False)


def test_chat_with_an_image_through_the_containers(containers: tuple[str, list[str]]) -> None:
    url, names = containers
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]

    def chat(content: list[dict]) -> dict:
        r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
            "model": model, "max_tokens": 8, "temperature": 0, "messages": [{"role": "user", "content": content}]})
        assert r.status_code == 200, r.text
        return r.json()

    text = {"type": "text", "text": "Describe the picture."}
    with_image = chat([{"type": "image_url", "image_url": {"url": _png_data_url()}}, text])
    text_only = chat([text])
    assert with_image["choices"][0]["message"]["content"]
    assert with_image["usage"]["completion_tokens"] == 8 or with_image["choices"][0]["finish_reason"] == "stop"
    # The image reached the model: its visual tokens are in the prompt.
    assert with_image["usage"]["prompt_tokens"] > text_only["usage"]["prompt_tokens"] + 4
    # Greedy decoding is deterministic across the container boundary too.
    again = chat([{"type": "image_url", "image_url": {"url": _png_data_url()}}, text])
    assert again["choices"][0]["message"]["content"] == with_image["choices"][0]["message"]["content"]
    # Both processes ran in their containers (not on the host).
    for name in names:
        assert json.loads(docker("inspect", name).stdout)[0]["State"]["Running"]
