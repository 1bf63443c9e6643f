"""lowerflow's orchestration layer: artifact store (``tasks.store``) and Prefect caching (``tasks.cache``)."""

from .store import ArtifactCorrupt, ArtifactMissing, ArtifactRef, ArtifactStore, StoreError

__all__ = ["ArtifactCorrupt", "ArtifactMissing", "ArtifactRef", "ArtifactStore", "StoreError"]
