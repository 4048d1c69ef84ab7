"""g5g-images: the build driver (manifests → plan → Dockerfiles → buildx), inspect, smoke and bench."""
from pathlib import Path

#: the checkout this package runs from: manifests/, patches/, dockerfiles/, serving/ live there
REPO_ROOT = Path(__file__).resolve().parent.parent
