"""LayerDrop at probability 0 as transformers 4.x writes it, in a model torch.fx cannot trace at its root.

Idioms: ``if self.training: dropout_probability = torch.rand([])`` then ``if dropout_probability <
self.layerdrop:`` inside the encoder's loop (transformers 4.x's Bart and Whisper), and the targets
shifted right into the decoder's inputs with a slice assignment in the root's ``forward``
(``shifted[:, 1:] = labels[:, :-1].clone()``, Bart's ``shift_tokens_right``), which torch.fx cannot
record. torch.export then meets the draw's branch; the real-tensor tracer takes it the way probability
0 always goes, the plan lists it, and ``run --check`` verifies it every step.
"""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 40
SEQ = 5
DIM = 16
START = 2


class Encoder(nn.Module):
    def __init__(self, layerdrop: float) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(2))
        self.layerdrop = layerdrop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            to_drop = False
            if self.training:
                dropout_probability = torch.rand([])
                if dropout_probability < self.layerdrop:  # skip the layer
                    to_drop = True
            if not to_drop:
                x = torch.relu(layer(x))
        return x


class Seq2Seq(nn.Module):
    def __init__(self, layerdrop: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.encoder = Encoder(layerdrop)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        shifted = labels.new_zeros(labels.shape)
        shifted[:, 1:] = labels[:, :-1].clone()
        shifted[:, 0] = START
        logits = self.head(self.encoder(self.embed(shifted)))
        loss = F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1))
        return {"loss": loss, "logits": logits}


def model() -> nn.Module:
    torch.manual_seed(0)
    return Seq2Seq().train()


def inputs(batch_size: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"labels": torch.randint(3, VOCAB, (batch_size, SEQ), generator=g)}


def loss(output: dict[str, torch.Tensor], targets: None) -> torch.Tensor:
    """The model's own loss (it computes it from the labels among its inputs)."""
    return output["loss"]
