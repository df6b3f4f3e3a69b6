"""The model catalogue: transformer shapes, exact parameter counts and per-module flops."""

from pathlib import Path

from commsim.models.hf import load_hf_config
from commsim.models.presets import MODEL_PRESETS, model_preset
from commsim.models.spec import ArchInfo, Kernel, ModelDescription, ModuleKind, ModuleSpec, ParamSpec, Role
from commsim.models.eager import PYTORCH_1_10, PYTORCH_2, TorchBehaviour
from commsim.models.transformer import TransformerConfig, describe


def resolve_model(name_or_path: str) -> TransformerConfig:
    """A preset name, or the path of a Hugging Face config.json."""
    if name_or_path in MODEL_PRESETS:
        return MODEL_PRESETS[name_or_path]
    p = Path(name_or_path)
    if p.is_dir() and (p / "config.json").exists():
        p = p / "config.json"
    if p.suffix == ".json" or p.exists():
        return load_hf_config(p)
    return model_preset(name_or_path)  # raises, listing the presets


__all__ = [
    "ArchInfo", "Kernel", "MODEL_PRESETS", "ModelDescription", "ModuleKind", "ModuleSpec", "ParamSpec",
    "PYTORCH_1_10", "PYTORCH_2", "Role", "TorchBehaviour", "TransformerConfig", "describe", "load_hf_config",
    "model_preset", "resolve_model",
]
