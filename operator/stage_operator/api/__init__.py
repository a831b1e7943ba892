"""The DiffusionStage API: spec and status as pydantic models (the CRD is generated from them)."""

from stage_operator.api.meta import API_VERSION, GROUP, KIND, PLURAL, VERSION
from stage_operator.api.spec import StageSpec
from stage_operator.api.status import Condition, StageStatus

__all__ = ["API_VERSION", "GROUP", "KIND", "PLURAL", "VERSION", "Condition", "StageSpec", "StageStatus"]
