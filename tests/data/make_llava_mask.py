"""Write tests/data/onnx/llava_mask.legacy.onnx: a tiny LLaVA-like model whose image features enter by a mask.

Run from the repository root with torch installed:

    python tests/data/make_llava_mask.py

Hugging Face's LLaVA puts the projected image features into the text
embeddings with ``inputs_embeds.masked_scatter(input_ids == image_token_id,
image_features)``. torch's legacy exporter writes that as ``Equal`` ->
``NonZero`` -> ``ScatterND``: a data-dependent ``NonZero`` that has nothing to
do with expert routing (there is no MoE here). The model keeps LLaVA's module
names (``vision_tower``, ``multi_modal_projector``, ``language_model``) and
its layer structure at toy sizes; the batch and sequence sizes are static.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

OUT = Path(__file__).resolve().parent / "onnx" / "llava_mask.legacy.onnx"
IMAGE_TOKEN = 63


class Block(nn.Module):
    """A pre-norm MLP block (attention left out: the mask is what this export is for)."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Tower(nn.Module):
    def __init__(self, width: int, layers: int):
        super().__init__()
        self.layers = nn.ModuleList(Block(width) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class VisionTower(nn.Module):
    def __init__(self, patch: int, width: int):
        super().__init__()
        self.embeddings = nn.Linear(patch, width)
        self.encoder = Tower(width, 2)

    def forward(self, patches):
        return self.encoder(self.embeddings(patches))


class LanguageModel(nn.Module):
    def __init__(self, vocab: int, width: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, width)
        self.layers = Tower(width, 2)
        self.lm_head = nn.Linear(width, vocab)

    def forward(self, embeds):  # takes embeddings, as LLaVA calls its language model with inputs_embeds
        return self.lm_head(self.layers(embeds))


class TinyLlava(nn.Module):
    def __init__(self, patch: int = 12, vision: int = 16, text: int = 32, vocab: int = 64):
        super().__init__()
        self.text_width = text
        self.vision_tower = VisionTower(patch, vision)
        self.multi_modal_projector = nn.Sequential(nn.Linear(vision, text), nn.GELU(), nn.Linear(text, text))
        self.language_model = LanguageModel(vocab, text)

    def forward(self, input_ids, pixel_patches):
        features = self.multi_modal_projector(self.vision_tower(pixel_patches)).reshape(-1, self.text_width)
        embeds = self.language_model.embed_tokens(input_ids)
        mask = (input_ids == IMAGE_TOKEN).unsqueeze(-1).expand_as(embeds)
        embeds = embeds.masked_scatter(mask, features)  # LLaVA's merge of image features into the text
        return self.language_model(embeds)


def main() -> None:
    torch.manual_seed(0)
    model = TinyLlava().eval()
    ids = torch.randint(0, IMAGE_TOKEN, (1, 10))
    ids[0, 1:5] = IMAGE_TOKEN  # 4 image tokens for 4 patches
    patches = torch.randn(1, 4, 12)
    torch.onnx.export(model, (ids, patches), str(OUT), dynamo=False, input_names=["input_ids", "pixel_patches"],
                      output_names=["logits"])
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
