"""kopf's diff base (the essence it compares to find spec changes), built without copying what it drops.

kopf builds an object's essence on every watch event of every kind it handles, by deep-copying the
whole body and then deleting its status and most of its metadata. An engine pod's body is mostly
status and managedFields, and a FlashModel's status is most of it: in a burst of 300 new models
that copy was about a tenth of the operator's CPU. This storage hands kopf a view without them, so
the copy is of what stays; the essence is the same.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

import kopf

KEPT_METADATA = ("labels", "annotations", "ownerReferences")
"""What kopf's build reads from metadata: labels and annotations go into the essence, ownerReferences
(with `kind`) names the storage key (a ReplicaSet of a Deployment gets its own)."""


class LeanDiffBaseStorage(kopf.AnnotationsDiffBaseStorage):
    def build(
        self,
        *,
        body: kopf.Body,
        extra_fields: Iterable[Any] | None = None,
    ) -> kopf.BodyEssence:
        if extra_fields:
            # A field handler may pick any field, status and metadata included: kopf's own copy.
            return super().build(body=body, extra_fields=extra_fields)
        meta = body.get("metadata") or {}
        lean: dict[str, Any] = {k: v for k, v in body.items() if k not in ("metadata", "status")}
        lean["metadata"] = {k: meta[k] for k in KEPT_METADATA if k in meta}
        return super().build(body=kopf.Body(cast(kopf.RawBody, lean)), extra_fields=extra_fields)
