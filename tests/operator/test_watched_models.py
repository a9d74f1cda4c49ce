"""The operator's store of FlashModels: the newest body seen, and when it can vouch for one."""

from __future__ import annotations

from typing import Any

from flashmodel_operator.watched_models import WatchedModels


def _model(version: int, generation: int = 1, name: str = "m") -> dict[str, Any]:
    return {
        "metadata": {
            "namespace": "ns",
            "name": name,
            "generation": generation,
            "resourceVersion": str(version),
            "managedFields": [{"manager": "kubectl", "fieldsV1": {"f:spec": {}}}],
        },
        "spec": {"replicas": generation},
    }


def _generation(models: WatchedModels) -> int | None:
    body = models.latest("ns", "m")
    return None if body is None else int(body["metadata"]["generation"])


def test_the_newest_body_wins_whichever_way_it_came() -> None:
    models = WatchedModels()
    models.event("ADDED", _model(10))
    models.record(_model(20, generation=2), models.listings)  # a pass read generation 2
    models.event("MODIFIED", _model(15))  # the watch's event of an older write, late
    assert _generation(models) == 2
    models.event("MODIFIED", _model(30, generation=3))
    models.record(_model(20, generation=2), models.listings)  # a read served before that event
    assert _generation(models) == 3
    kept = models.latest("ns", "m")
    assert kept is not None and "managedFields" not in kept["metadata"]


def test_a_read_served_before_a_deletion_does_not_bring_the_model_back() -> None:
    models = WatchedModels()
    models.event("ADDED", _model(10))
    listings = models.listings
    models.event("DELETED", _model(12))
    models.record(_model(11), listings)
    assert models.latest("ns", "m") is None and models.get("ns", "m") is None and ("ns", "m") not in models
    models.event("ADDED", _model(40))  # made again under the same name
    assert _generation(models) == 1 and len(models) == 1


def test_after_a_listing_a_model_is_vouched_for_only_once_seen_again() -> None:
    # kopf lists again after its watch expired; a model deleted in between sent no DELETED event.
    models = WatchedModels()
    models.event("ADDED", _model(10))
    models.event(None, _model(50, name="other"))
    assert models.latest("ns", "m") is None, "not in the listing so far: it may be gone"
    assert models.get("ns", "m") is not None, "the pod polls still see it"
    listings = models.listings
    models.record(_model(10), listings)  # a read after the listing: it exists
    assert _generation(models) == 1
    before = models.listings
    models.event(None, _model(60, name="third"))
    models.record(_model(10), before)  # a read sent before that listing says nothing of after it
    assert models.latest("ns", "m") is None
