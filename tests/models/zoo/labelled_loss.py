"""A classifier that computes its own loss over the labelled samples, as HF DeBERTa-v2 writes it.

Idioms: ``position_ids = self.position_ids[:, :seq_length]`` in the root's forward (a slice of a buffer
with a bound read from a tensor's size: torch.fx stops there), and the loss over the rows whose label
is not negative: ``label_index = (labels >= 0).nonzero()`` then ``if label_index.size(0) > 0:`` (a
branch on a data-dependent size: torch.export stops there). Both are in the root's own code, so the
real-tensor tracer specialises the branch on the values seen (every sample labelled), the plan lists
it with its file and line, and ``run --check`` verifies it.
"""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 50
SEQ = 6
MAX_POSITIONS = 16
DIM = 16
CLASSES = 3


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.position = nn.Embedding(MAX_POSITIONS, DIM)
        self.register_buffer("position_ids", torch.arange(MAX_POSITIONS).expand((1, -1)), persistent=False)
        self.encoder = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        seq_length = input_ids.size(1)
        position_ids = self.position_ids[:, :seq_length]
        hidden = self.embed(input_ids) + self.position(position_ids)
        logits = self.head(torch.tanh(self.encoder(hidden)).mean(dim=1))
        label_index = (labels >= 0).nonzero()
        labels = labels.long()
        if label_index.size(0) > 0:
            labeled_logits = torch.gather(logits, 0, label_index.expand(label_index.size(0), logits.size(1)))
            labels = torch.gather(labels, 0, label_index.view(-1))
            loss = F.cross_entropy(labeled_logits.view(-1, CLASSES).float(), labels.view(-1))
        else:
            loss = torch.tensor(0).to(logits)
        return {"loss": loss, "logits": logits}


def model() -> nn.Module:
    torch.manual_seed(0)
    return Classifier().train()


def inputs(batch_size: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"input_ids": torch.randint(0, VOCAB, (batch_size, SEQ), generator=g),
            "labels": torch.randint(0, CLASSES, (batch_size,), generator=g)}


def loss(output: dict[str, torch.Tensor], targets: None) -> torch.Tensor:
    """The model's own loss (it computes it from the labels among its inputs)."""
    return output["loss"]
