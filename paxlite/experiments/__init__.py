"""The registry: every experiment a user can name with --fdl_config, by its short name.

An explicit dict (no import-time registration side effects). Dotted paths
(`paxlite.experiments.gpt.GPT126M`), legacy Pax names
(`paxml.contrib.gpu.scripts_gpu.configs.Pile126M`) and aliases (AXLearn's `fuji-7B-v2` for
`Fuji7BV2`, Pax's `GLaM126M64EBase` for `GLaM126M64E`, Hugging Face's `meta-llama/Llama-3.1-8B` for
`LLaMA3_1_8B`) resolve through
`paxlite.config.registry.resolve_experiment`.
"""

from __future__ import annotations

from paxlite.config.registry import Registry
from paxlite.experiments import (
    deepseek,
    finetune,
    fuji,
    gemma,
    glam,
    gpt,
    gpt_oss,
    llama,
    llama3,
    llama4,
    mistral,
    mixtral,
    qwen,
    tiny,
)

EXPERIMENTS = Registry(
    {
        "GPT126M": gpt.GPT126M,
        "GPT5B": gpt.Pile5B,  # Pax aliases GPT5B = Pile5B
        "GPT175B": gpt.Pile175B,  # and GPT175B = Pile175B
        "Synthetic126M": gpt.Synthetic126M,
        "Synthetic5B": gpt.Synthetic5B,
        "Synthetic175B": gpt.Synthetic175B,
        "Pile126M": gpt.Pile126M,
        "Pile5B": gpt.Pile5B,
        "Pile175B": gpt.Pile175B,
        "Lambada126M": gpt.Lambada126M,
        "LLaMA7B": llama.LLaMA7B,
        "LLaMA13B": llama.LLaMA13B,
        "LLaMA70B": llama.LLaMA70B,
        "TinySynthetic": tiny.TinySynthetic,
        "TinySyntheticRepeated": tiny.TinySyntheticRepeated,
        "DemoSynthetic": tiny.DemoSynthetic,
        "TinyShakespeare": tiny.TinyShakespeare,
        **{cls.__name__: cls for cls in glam.GLAM_EXPERIMENTS},
        "Mixtral8x7B": mixtral.Mixtral8x7B,
        "TinyGLaM": tiny.TinyGLaM,
        "TinyMixtral": tiny.TinyMixtral,
        **{cls.__name__: cls for cls in fuji.FUJI_EXPERIMENTS},
        **{cls.__name__: cls for cls in llama3.LLAMA3_EXPERIMENTS},
        **{cls.__name__: cls for cls in mistral.MISTRAL_EXPERIMENTS},
        **{cls.__name__: cls for cls in qwen.QWEN_EXPERIMENTS},
        **{cls.__name__: cls for cls in gemma.GEMMA_EXPERIMENTS},
        "FineTune": finetune.FineTune,
        **{cls.__name__: cls for cls in deepseek.DEEPSEEK_EXPERIMENTS},
        **{cls.__name__: cls for cls in llama4.LLAMA4_EXPERIMENTS},
        **{cls.__name__: cls for cls in gpt_oss.GPT_OSS_EXPERIMENTS},
    },
    aliases={**fuji.AXLEARN_NAMES, **glam.PAX_NAMES,
             **{hf_id: cls.__name__ for cls in (*llama3.LLAMA3_EXPERIMENTS,
                                                *mistral.MISTRAL_EXPERIMENTS,
                                                *qwen.QWEN_EXPERIMENTS, *gemma.GEMMA_EXPERIMENTS,
                                                *deepseek.DEEPSEEK_EXPERIMENTS,
                                                *llama4.LLAMA4_EXPERIMENTS,
                                                *gpt_oss.GPT_OSS_EXPERIMENTS)
                for hf_id in cls.hf_ids}},
)
