"""Benchmarks behind `triptych bench`: one module per concern.

- workload.py: the synthetic multimodal request set and its Poisson arrivals
- stats.py: percentiles and the SLO math (HydraInfer §2.3: attainment, goodput)
- prom_text.py: Prometheus text scrapes -> histogram quantiles and counter deltas
- client.py: one timed streaming request, /metrics scrapes, endpoint discovery
- loadgen.py: open-loop load at each rate of a plan against a router (`bench serve`)
- report.py: tables and plots
- topologies.py: the same load against several local deployments
- idle_cpu.py: CPU each process of a local deployment burns while idle (`bench idle`)
- neighbours.py: one instance's decode throughput alone and beside busy neighbours,
  with and without CPU quotas (`bench neighbours`)
- nixl_bandwidth.py: raw NIXL READ bandwidth between two processes (imports torch lazily)
- engine.py: our engine against transformers on CPU (`bench engine`; imports torch)
- serve.py: the `bench serve` command

Only engine.py and nixl_bandwidth.py touch torch; everything `bench serve` and `bench
idle` import at start-up is torch-free (they are clients).
"""
