"""The time-to-quality panel: four blocks of real networks this project never tuned or benchmarked against,
chosen before any tuning and kept fixed. Each comes from a constructor that ships with Hugging Face
transformers (no weights downloaded: seeded random initialisation, eval mode, batch 1) and gives 9-15
MetaSchedule tasks on a CUDA target.

    efficientnet-mbconv  EfficientNet-B0's MBConv (expand 6, 5x5 depthwise, squeeze-excite), 40 -> 80 ch, stride 2, 28x28
    regnety-stage        a RegNetY stage (group width 8, squeeze-excite), 48 -> 104 ch, depth 2, stride 2, 56x56
    vit-s-encoder        one ViT-S/16 encoder layer (384 wide, 6 heads, MLP 1536), 197 tokens
    wav2vec2-conv        wav2vec 2.0's convolutional feature encoder cut to 3 layers (256 ch), 0.5 s of 16 kHz audio
"""
from __future__ import annotations

from typing import Callable

SEED = 0


def _finish(module, *shapes):
    import torch

    module.eval()
    gen = torch.Generator().manual_seed(SEED + 1)
    return module, tuple(torch.randn(*s, generator=gen) for s in shapes)


def _first_output(layer):
    """Hugging Face layers return tuples; a Relax model needs one tensor."""
    import torch

    class FirstOutput(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = layer

        def forward(self, x):
            out = self.layer(x)
            return out[0] if isinstance(out, tuple) else out

    return FirstOutput()


def efficientnet_mbconv():
    import torch
    from transformers import EfficientNetConfig
    from transformers.models.efficientnet.modeling_efficientnet import EfficientNetBlock

    torch.manual_seed(SEED)
    block = EfficientNetBlock(EfficientNetConfig(), in_dim=40, out_dim=80, stride=2, expand_ratio=6, kernel_size=5,
                              drop_rate=0.0, id_skip=True, adjust_padding=False)
    return _finish(block, (1, 40, 28, 28))


def regnety_stage():
    import torch
    from transformers import RegNetConfig
    from transformers.models.regnet.modeling_regnet import RegNetStage

    torch.manual_seed(SEED)
    stage = RegNetStage(RegNetConfig(layer_type="y", groups_width=8), 48, 104, stride=2, depth=2)
    return _finish(stage, (1, 48, 56, 56))


def vit_s_encoder():
    import torch
    from transformers import ViTConfig
    from transformers.models.vit.modeling_vit import ViTLayer

    torch.manual_seed(SEED)
    cfg = ViTConfig(hidden_size=384, num_attention_heads=6, intermediate_size=1536, attn_implementation="eager")
    return _finish(_first_output(ViTLayer(cfg)), (1, 197, 384))


def wav2vec2_conv():
    import torch
    from transformers import Wav2Vec2Config
    from transformers.models.wav2vec2.modeling_wav2vec2 import Wav2Vec2FeatureEncoder

    torch.manual_seed(SEED)
    cfg = Wav2Vec2Config(feat_extract_norm="layer", conv_dim=(256, 256, 256), conv_stride=(5, 2, 2),
                         conv_kernel=(10, 3, 3))
    return _finish(Wav2Vec2FeatureEncoder(cfg), (1, 8000))


PANEL: dict[str, Callable] = {
    "efficientnet-mbconv": efficientnet_mbconv,
    "regnety-stage": regnety_stage,
    "vit-s-encoder": vit_s_encoder,
    "wav2vec2-conv": wav2vec2_conv,
}


def build(name: str):
    """(torch module, example inputs) of a panel model; a zoo name builds the zoo's model."""
    if name in PANEL:
        return PANEL[name]()
    from sharetune.zoo import get

    return get(name).build()


def relax(name: str):
    """The Relax IRModule of a panel or zoo model."""
    from sharetune.intake import to_relax

    module, inputs = build(name)
    return to_relax(module, inputs).mod


def model_arg(name: str):
    """What a job is submitted with: a panel model as its Relax module, a zoo model by its name."""
    return relax(name) if name in PANEL else name
