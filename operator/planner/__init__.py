"""The planner: workloads, step-time profiles, a discrete-event simulator of an E/P/D
deployment, the offline optimizer (hybrid method and instance ratio), the live signals
snapshot, the pure autoscaling policy and the actuation interface.

Nothing here imports torch or the worker's engine: the same code runs inside the operator
and locally (`triptych simulate`, `triptych plan`). See docs/planner.md.
"""
