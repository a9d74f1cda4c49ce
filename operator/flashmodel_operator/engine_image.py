"""Which engine image a FlashModel's pods run: the cluster's, or another the cluster admin allows.

The engine image is trusted code: its launcher is what enforces the profile, so an image a user
picks could run vLLM with any flags. The cluster's image comes from the operator's configuration
(the chart's `engineImage`), so a chart upgrade moves every model to the new engine and a
private-registry cluster sets it once. `spec.engine.image` may name another only where the admin
lists it (`engineImage.allowed`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from flashmodel_engine import __version__

LEGACY_DEFAULT = "ghcr.io/flashmodel/engine:0.1.0"
"""What the CRD's default wrote into every FlashModel stored before the image became the cluster's: such
a model runs the cluster's image, as if it named none (it never chose this one)."""
DEFAULT_IMAGE = f"ghcr.io/flashmodel/engine:{__version__}"


@dataclass(frozen=True)
class EngineImagePolicy:
    """The cluster's engine image, the others a FlashModel may name, and the pods' pull secrets."""

    image: str = DEFAULT_IMAGE
    """FLASHMODEL_ENGINE_IMAGE: what every engine pod runs unless its FlashModel names an allowed other."""
    allowed: tuple[str, ...] = ()
    """FLASHMODEL_ALLOWED_ENGINE_IMAGES (comma-separated, exact references): what spec.engine.image may name."""
    pull_secrets: tuple[str, ...] = ()
    """FLASHMODEL_ENGINE_IMAGE_PULL_SECRETS (comma-separated Secret names, in each model's namespace)."""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> EngineImagePolicy:
        def listed(name: str) -> tuple[str, ...]:
            return tuple(item.strip() for item in environ.get(name, "").split(",") if item.strip())

        image = environ.get("FLASHMODEL_ENGINE_IMAGE", "").strip() or DEFAULT_IMAGE
        return cls(image, listed("FLASHMODEL_ALLOWED_ENGINE_IMAGES"), listed("FLASHMODEL_ENGINE_IMAGE_PULL_SECRETS"))

    def choose(self, requested: str | None) -> tuple[str, str | None]:
        """The image to run for this spec.engine.image, and why it is refused (None when it is not)."""
        if requested is None or (requested == LEGACY_DEFAULT and requested not in self.allowed):
            return self.image, None
        if requested == self.image or requested in self.allowed:
            return requested, None
        allowed = ", ".join(self.allowed) if self.allowed else "none"
        return self.image, (
            f"spec.engine.image {requested!r} is not an engine image this cluster allows (its image: {self.image}; "
            f"others allowed: {allowed}): an engine image carries the launcher that enforces the profile; remove "
            "spec.engine.image to run the cluster's, or ask the cluster admin to add it to the chart's "
            "engineImage.allowed"
        )


_current = EngineImagePolicy()


def current() -> EngineImagePolicy:
    return _current


def load(environ: Mapping[str, str] | None = None) -> EngineImagePolicy:
    """Read the environment once, at start-up, beside the operator's settings."""
    global _current
    _current = EngineImagePolicy.from_environ(os.environ if environ is None else environ)
    return _current


def use(policy: EngineImagePolicy) -> None:
    """Install a policy directly (tests)."""
    global _current
    _current = policy
