"""`triptych worker`: an engine instance (worker/server.py) or, for `--role V`, a video
decoder instance (worker/video_instance.py) — chosen before either is imported, so a V
process never imports the engine or any model code."""

from __future__ import annotations

import argparse

from triptych.cpu_binding import bind_current_thread
from triptych.topology import InstanceType


def cli_main(args: argparse.Namespace) -> int:
    if getattr(args, "service_cpus", None):  # first: every thread started from here on inherits it
        bind_current_thread(args.service_cpus)
    if args.role == InstanceType.V.value:
        from triptych.worker.video_instance import cli_main as video_main

        return video_main(args)
    from triptych.worker.server import cli_main as server_main

    return server_main(args)
