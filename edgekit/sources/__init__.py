"""Model and data sources."""
from edgekit.sources.handle import InputSpec, ModelHandle, StepRecord
from edgekit.sources.models import load_model

__all__ = ["InputSpec", "ModelHandle", "StepRecord", "load_model"]
