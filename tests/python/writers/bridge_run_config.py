#!/usr/bin/env python3
"""Megatron-Bridge's run_config.yaml for an HF model, as Megatron-Bridge 0.3.1 writes it into each
checkpoint's iter_N/ (training/checkpointing.py's save_checkpoint: `cfg.to_yaml(config_filename)`):

    python bridge_run_config.py HF_DIR:OUT_DIR:TP:PP:EP [...]

writes OUT_DIR/run_config.yaml for each model (Bridge's train_state.pt beside it is not written:
its TrainState module imports tensorboard).

The model provider is what a Bridge user's recipe builds from the HF model's config:
`AutoBridge.from_hf_config(config).to_megatron_provider(load_weights=False)` (the recipes'
`cfg.model = AutoBridge.from_hf_pretrained(...).to_megatron_provider(load_weights=False)`), with
the run's parallel sizes set on it; the ConfigContainer around it is the recipes' `_pretrain_common()`; the
file is its own `to_yaml`. Megatron-Bridge saves the weights with megatron-core's
dist_checkpointing.save and keeps no Megatron-LM `args` in common.pt: the model config is this file.

Megatron-Bridge 0.3.1 is the newest release for Python 3.11 (0.4 and later need 3.12); it declares
transformers<5 and Transformer Engine, and is installed with --no-deps (tools/
requirements-frameworks.txt). Importing its config modules without those needs three things,
none of which touches what is written:
  - `datasets` (Hugging Face datasets, for its data builders) is a stub module whose names are
    empty classes;
  - megatron.bridge.peft.lora and .lora_layers (LoRA layers on Transformer Engine, imported by
    its model-conversion package) are stub modules with empty classes of the names others import;
  - megatron.bridge.recipes' package __init__ (which imports every recipe, VLMs and their data
    stack included) is skipped: only recipes/common.py is loaded.
"""
import importlib.util
import os
import sys
import types


def _stub(name, **attrs):
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    sys.modules[name] = m
    return m


def import_bridge():
    class Placeholder:  # a name other modules import from a stubbed one; never used here
        pass

    if importlib.util.find_spec("datasets") is None:
        ds = _stub("datasets")

        def missing(n):
            if n.startswith("__"):
                raise AttributeError(n)
            setattr(ds, n, type(n, (), {}))
            return getattr(ds, n)

        ds.__getattr__ = missing
    _stub("megatron.bridge.peft.lora_layers", LinearAdapter=Placeholder, LoRALinear=Placeholder,
          LoRATopKRouter=Placeholder)
    _stub("megatron.bridge.peft.lora", LoRA=type("LoRA", (), {}), LoRAMerge=Placeholder,
          VLMLoRA=Placeholder)
    import megatron.bridge as mb

    recipes = types.ModuleType("megatron.bridge.recipes")
    recipes.__path__ = [os.path.join(os.path.dirname(mb.__file__), "recipes")]
    sys.modules["megatron.bridge.recipes"] = recipes
    from megatron.bridge import AutoBridge
    from megatron.bridge.recipes.common import _pretrain_common

    return AutoBridge, _pretrain_common


def as_transformers4(config):
    """The HF config as transformers 4 held it, which Megatron-Bridge 0.3.1 reads: transformers 5
    keeps rope_theta and rope_scaling inside rope_parameters, where 0.3.1's CONFIG_MAPPING
    ("rope_theta" -> rotary_base) and its YaRN mapping (rope_scaling) do not look; without this
    it writes its default rotary_base (10000) for any model. DeepSeek V3's hub config.json
    carries `scoring_func: sigmoid` (and 0.3.1's CONFIG_MAPPING reads it), which transformers 5's
    DeepseekV3Config neither writes nor keeps (its router is always sigmoid): set as the hub's
    config.json holds it, else 0.3.1 writes its MLA provider's default, softmax."""
    if getattr(config, "model_type", None) == "deepseek_v3" and not hasattr(config, "scoring_func"):
        config.scoring_func = "sigmoid"
    rp = getattr(config, "rope_parameters", None)
    if isinstance(rp, dict) and "rope_theta" in rp:
        config.rope_theta = rp["rope_theta"]
        if rp.get("rope_type", "default") != "default":
            config.rope_scaling = {**{k: v for k, v in rp.items() if k != "rope_theta"}, "type": rp["rope_type"]}
    return config


def main():
    AutoBridge, pretrain_common = import_bridge()
    import transformers

    for case in sys.argv[1:]:
        hf_dir, out, tp, pp, ep = case.rsplit(":", 4)
        config = as_transformers4(transformers.AutoConfig.from_pretrained(hf_dir))
        provider = AutoBridge.from_hf_config(config).to_megatron_provider(load_weights=False)
        provider.tensor_model_parallel_size = int(tp)
        provider.pipeline_model_parallel_size = int(pp)
        provider.expert_model_parallel_size = int(ep)
        cfg = pretrain_common()
        cfg.model = provider
        cfg.to_yaml(os.path.join(out, "run_config.yaml"))
        print(out, type(provider).__name__, flush=True)


if __name__ == "__main__":
    main()
