"""kopf's diff base (the essence it compares to find spec changes): built without copying what it
drops (LeanDiffBaseStorage), and kept in memory instead of an annotation (HandledSpecs); kopf's
progress annotations without its marker (UnmarkedProgressStorage). With both, a new model's handler
that succeeds writes nothing to the model but its status.

kopf builds an object's essence on every watch event of every kind it handles, by deep-copying the
whole body and then deleting its status and most of its metadata. An engine pod's body is mostly
status and managedFields, and a FlashModel's status is most of it: in a burst of 300 new models
that copy was about a tenth of the operator's CPU. This storage hands kopf a view without them, so
the copy is of what stays; the essence is the same.
"""

from __future__ import annotations

import hashlib
import json
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


class HandledSpecs(LeanDiffBaseStorage):
    """kopf's diff base kept in the operator's memory, as a digest per object, instead of an annotation.

    kopf's annotation storage writes the handled essence into the object after every handled change:
    one more PATCH of each new model (and of each spec change), the dearest FlashModel request after
    the status write (about 10 ms of API server CPU: docs/benchmarks/operator.md, "A budget only where
    it protects, and no kopf write to the model"), and one more watch event for every watcher of the
    model. What kopf needs from the diff base is whether the object changed since it was last
    handled: a digest of the essence answers that. After a restart nothing is known, so every model
    comes as "create" (the one handler takes create, update and resume alike and reads the latest
    object), which is what a resume pass does today. The digest is of the essence without extra
    fields: the operator registers no field handler.
    """

    def __init__(self, *, prefix: str, key: str) -> None:
        super().__init__(prefix=prefix, key=key)
        self._handled: dict[str, bytes] = {}

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        digest = self._handled.get(body.metadata.uid or "")
        if digest is None:
            return None
        current = self.build(body=body)
        # Unchanged: the essence itself, so kopf sees no diff. Changed: an empty essence, so kopf sees
        # one (the handler reads the object, not kopf's diff).
        return current if _digest(current) == digest else cast(kopf.BodyEssence, {})

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        uid = body.metadata.uid
        if uid:
            self._handled[uid] = _digest(essence)

    def forget(self, uid: str) -> None:
        """The object is gone: a new one of the same name has a uid of its own."""
        self._handled.pop(uid, None)

    def __len__(self) -> int:
        return len(self._handled)


def _digest(essence: kopf.BodyEssence) -> bytes:
    return hashlib.blake2b(json.dumps(essence, sort_keys=True, separators=(",", ":")).encode(), digest_size=16).digest()


class UnmarkedProgressStorage(kopf.AnnotationsProgressStorage):
    """kopf's progress annotations (a failing handler's retries), without kopf's marker annotation.

    kopf marks every object it first stores progress for with `<prefix>/kopf-managed: yes`, which it
    reads only to tell its own annotations from another kopf operator's. A handler that succeeds at
    once stores its progress and purges it in the same patch, so the marker was all that patch wrote:
    a PATCH of every new model. The progress annotations of a handler that fails are kept as they
    are, so its retries work the same.
    """

    def _store_marker(self, prefix: str, patch: kopf.Patch, body: kopf.Body) -> None:
        return None
