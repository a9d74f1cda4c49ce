"""Run the operator: `python -m flashmodel_operator [kopf run options]`."""

from __future__ import annotations

import os
import sys

from flashmodel_operator import engine_image, extra_args_policy, heap, network_policy, pod_policy, routing, settings


def main() -> None:
    if "PYTHONMALLOC" not in os.environ:
        # glibc's allocator, so freed memory can go back to the system (flashmodel_operator.heap);
        # only the interpreter's start chooses it. Set PYTHONMALLOC yourself to choose another.
        os.environ["PYTHONMALLOC"] = "malloc"
        os.execv(sys.executable, [sys.executable, "-m", "flashmodel_operator", *sys.argv[1:]])
    # kopf's own CLI parses the options (--all-namespaces, --namespace, --peering, --liveness,
    # --standalone); this entry point only pins which module holds the handlers.
    try:
        settings.load()  # once, before kopf imports the handlers, which take their timings from it
        engine_image.load()
        network_policy.load()
        routing.load()
        extra_args_policy.load()
        pod_policy.load()
    except ValueError as exc:
        sys.exit(f"flashmodel-operator: {exc}")
    heap.tune_collector()
    sys.argv = [sys.argv[0], "run", "--module", "flashmodel_operator.handlers", *sys.argv[1:]]
    from kopf.cli import main as kopf_main  # kopf's click group

    kopf_main()


if __name__ == "__main__":
    main()
