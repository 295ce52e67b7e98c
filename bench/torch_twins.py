"""torch twins of the example models (examples/train_gpt.py's GPT, examples/train_convnet.py's
ConvNet): same structure, same state_dict keys. They are the torch peers of bench/models.py and
bench/amp.py; the state_dict round-trip tests use them as the oracle (through
tests/support/torch_models.py), as tests use bench/dist_autograd_torch.py's twins."""

from __future__ import annotations

import torch


class TorchGPT(torch.nn.Module):
    """torch's GPT matching examples.train_gpt.GPT."""

    def __init__(self, vocab_size: int, context: int = 64, d_model: int = 144, n_layer: int = 4,
                 n_head: int = 4) -> None:
        super().__init__()
        self.context = context
        self.tok = torch.nn.Embedding(vocab_size, d_model)
        self.pos = torch.nn.Embedding(context, d_model)
        block = torch.nn.TransformerEncoderLayer(
            d_model, n_head, dim_feedforward=4 * d_model, dropout=0.0,
            activation=torch.nn.GELU(approximate="tanh"), batch_first=True, norm_first=True,
        )
        self.blocks = torch.nn.TransformerEncoder(block, n_layer, enable_nested_tensor=False)
        self.ln_f = torch.nn.LayerNorm(d_model)
        self.head = torch.nn.Linear(d_model, vocab_size, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t))
        mask = torch.nn.Transformer.generate_square_subsequent_mask(t, dtype=x.dtype)
        x = self.blocks(x, mask=mask, is_causal=True)
        return self.head(self.ln_f(x))


class TorchConvNet(torch.nn.Module):
    """torch's ConvNet matching examples.train_convnet.ConvNet."""

    def __init__(self, classes: int = 10, width: int = 32) -> None:
        super().__init__()
        nn = torch.nn
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.classifier = nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))
