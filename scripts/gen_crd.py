"""Write the FlashModel CRD's spec and status schemas from the operator's pydantic models (model, status_model).

    python scripts/gen_crd.py          # rewrite crds/flashmodel.yaml and the chart's copy
    python scripts/gen_crd.py --check  # exit 1 when either differs from what the models give

Only the `spec:` and `status:` blocks under openAPIV3Schema are generated; the rest of the file is written by hand.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "operator"), str(ROOT / "engine")]

from flashmodel_operator.crd_schema import CHART_CRD, SOURCE_CRD, render_crd  # noqa: E402


def main(argv: list[str]) -> int:
    text = render_crd((ROOT / SOURCE_CRD).read_text())
    stale = [p for p in (SOURCE_CRD, CHART_CRD) if (ROOT / p).read_text() != text]
    if "--check" in argv:
        for path in stale:
            print(f"{path} is not what flashmodel_operator.model gives: run python scripts/gen_crd.py", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        (ROOT / path).write_text(text)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
