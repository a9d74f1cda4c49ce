"""Run the operator: `python -m flashmodel_operator [kopf run options]`."""

from __future__ import annotations

import sys

from flashmodel_operator import settings


def main() -> None:
    # kopf's own CLI parses the options (--all-namespaces, --namespace, --peering, --liveness,
    # --standalone); this entry point only pins which module holds the handlers.
    try:
        settings.load()  # once, before kopf imports the handlers, which take their timings from it
    except ValueError as exc:
        sys.exit(f"flashmodel-operator: {exc}")
    sys.argv = [sys.argv[0], "run", "--module", "flashmodel_operator.handlers", *sys.argv[1:]]
    from kopf.cli import main as kopf_main  # kopf's click group

    kopf_main()


if __name__ == "__main__":
    main()
