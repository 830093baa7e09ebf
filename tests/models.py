"""Small architectures that exercise every path of the engine (shared by the tests)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn


class MLP(nn.Module):
    def __init__(self, d_in=5, hidden=7, d_out=3):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, d_out)

    def forward(self, x):
        return self.head(torch.relu(self.fc2(torch.tanh(self.fc1(x)))))


class CNN(nn.Module):
    """Conv2d + BatchNorm (eval, non-trivial running statistics) + GroupNorm + reflect padding."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(2, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 4, 3, stride=2, padding=1, padding_mode="reflect")
        self.gn = nn.GroupNorm(2, 4)
        self.conv3 = nn.Conv1d(4, 3, 2, dilation=2)
        self.head = nn.Linear(3, 3)
        with torch.no_grad():
            self.bn.running_mean.uniform_(-0.5, 0.5)
            self.bn.running_var.uniform_(0.5, 2.0)
            for norm in (self.bn, self.gn):
                norm.weight.uniform_(0.5, 1.5)
                norm.bias.uniform_(-0.3, 0.3)

    def forward(self, x):
        h = torch.tanh(self.bn(self.conv1(x)))
        h = torch.tanh(self.gn(self.conv2(h)))  # [B, 4, 3, 3]
        h = torch.tanh(self.conv3(h.flatten(2)))  # [B, 3, 7]
        return self.head(h.mean(-1))


class TinyTransformer(nn.Module):
    """Embedding (with padding_idx) + a root-owned positional parameter + hand-written attention
    on Linear q/k/v (weights shared over tokens) + nn.MultiheadAttention + LayerNorm."""

    def __init__(self, vocab=11, dim=6, seq=5, d_out=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=0)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.1)
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.mha = nn.MultiheadAttention(dim, 2, batch_first=True)
        self.head = nn.Linear(dim, d_out)

    def forward(self, tokens):
        h = self.embed(tokens) + self.pos
        att = torch.softmax(self.q(h) @ self.k(h).transpose(1, 2) / h.shape[-1] ** 0.5, dim=-1)
        h = self.norm(h + att @ self.v(h))
        h = h + self.mha(h, h, h, need_weights=False)[0]
        return self.head(h.mean(1))


class SharedPositions(nn.Module):
    """An embedding of positions shared by all samples (its input has no sample axis)."""

    def __init__(self, vocab=5, dim=4, seq=3):
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.head = nn.Linear(dim, 2)

    def forward(self, ids):
        h = self.tokens(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        return self.head(torch.tanh(h).mean(1))


class PositionsIntoAttention(nn.Module):
    """Positions looked up once (1-D ids) and given a batch axis of one ([None]) before
    nn.MultiheadAttention, which asserts that its query has at most three axes."""

    def __init__(self, vocab=7, dim=4, seq=3):
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.attention = nn.MultiheadAttention(dim, 2, batch_first=True)
        self.head = nn.Linear(dim, 2)

    def forward(self, ids):
        h = self.tokens(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))[None]
        return self.head(self.attention(h, h, h, need_weights=False)[0].mean(1))


class SequenceFirst(nn.Module):
    """Linear layers on a sequence-first [S, B, F] tensor (nn.TransformerEncoderLayer's default
    layout): their first axis is not the sample axis."""

    def __init__(self, d_in=3, dim=4, d_out=3):
        super().__init__()
        self.inp = nn.Linear(d_in, dim)
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, d_out)

    def forward(self, x):  # [B, S, d_in]
        h = torch.tanh(self.inp(x)).transpose(0, 1)  # [S, B, dim]
        return self.head(torch.tanh(self.mix(h)).mean(0))


class Tied(nn.Module):
    """A weight registered in two modules, an embedding matrix reused as an output projection
    outside its module, and a module called twice, once under each of its two names."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(4, 4)
        self.dec = nn.Linear(4, 4)
        self.dec.weight = self.enc.weight
        self.twice = nn.Linear(4, 4)
        self.again = self.twice  # one module, two names
        self.emb = nn.Embedding(3, 4)

    def forward(self, x):
        h = torch.tanh(self.enc(x))
        h = torch.tanh(self.again(torch.tanh(self.twice(h))))
        h = self.dec(h)
        return F.linear(h, self.emb.weight)  # [B, 3]


class Frozen(MLP):
    def __init__(self):
        super().__init__()
        self.fc1.weight.requires_grad_(False)
        self.head.bias.requires_grad_(False)


class CallCounter(MLP):
    """An MLP that counts its forward passes in a buffer, written in place (in eval mode too)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls += 1
        return super().forward(x)


class Chunked(nn.Module):
    """Per sample, but its body runs once per chunk of `size` samples (micro-batches)."""

    def __init__(self, size: int):
        super().__init__()
        self.size = size
        self.body = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 8))
        self.out = nn.Linear(8, 2)

    def forward(self, x):
        return self.out(torch.tanh(torch.cat([self.body(c) for c in x.split(self.size)])))


class Checkpointed(nn.Module):
    """A LayerNorm + Linear segment under activation checkpointing (torch.utils.checkpoint,
    use_reentrant=False: recomputed in the backward pass), or run plainly (checkpointed=False),
    the same function."""

    def __init__(self, checkpointed: bool = True):
        super().__init__()
        self.checkpointed = checkpointed
        self.pre = nn.Linear(4, 6)
        self.body = nn.Sequential(nn.LayerNorm(6), nn.Tanh(), nn.Linear(6, 6))
        self.out = nn.Linear(6, 3)

    def forward(self, x):
        h = torch.tanh(self.pre(x))
        if self.checkpointed:
            h = torch.utils.checkpoint.checkpoint(self.body, h, use_reentrant=False)
        else:
            h = self.body(h)
        return self.out(torch.tanh(h))


class PackedGRU(nn.Module):
    """Sequences of variable length (trailing zero rows are padding) packed through an nn.GRU:
    torch.func cannot differentiate the packed RNN kernel even one sample at a time."""

    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(3, 5, batch_first=True)
        self.out = nn.Linear(5, 2)

    def forward(self, x):
        lengths = (x.abs().sum(-1) > 0).sum(1).clamp(min=1).cpu()
        packed = nn.utils.rnn.pack_padded_sequence(
            x, lengths, batch_first=True, enforce_sorted=False
        )
        return self.out(self.gru(packed)[1][-1])


class Scalar(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = MLP(d_out=1)

    def forward(self, x):
        return self.body(x).squeeze(-1)  # [B]


class TwoLogits(nn.Module):
    """The binary classifier `net` (one logit z) written with the class logits (0, z)."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x):
        z = self.net(x)
        return torch.cat([torch.zeros_like(z), z], 1)


class TwoDtypes(nn.Module):
    """A float32 body with a float64 head, as a float32 head on a bfloat16 body."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(5, 6)
        self.head = nn.Linear(6, 3).double()

    def forward(self, x):
        h = torch.tanh(self.body(x.to(self.body.weight.dtype)))
        return self.head(h.to(self.head.weight.dtype))


class DictInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 4)
        self.b = nn.Linear(2, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, a, b):
        return self.out(torch.tanh(self.a(a) + self.b(b)))


class DictOutput(nn.Module):
    """`net` returning its logits in a dict, as HuggingFace models do (read with output_fn)."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x):
        return {"logits": self.net(x)}


class WideScale(nn.Module):
    """An elementwise scale of d features read from a parameter with `size` entries and no
    Kronecker structure (the factored curvature holds at most attribution.curvature.MAX_DENSE)."""

    def __init__(self, d: int, size: int):
        super().__init__()
        self.d = d
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x):
        return x * self.weight[: self.d]


def fitted(model: nn.Module, x, y, steps: int, lr: float = 0.05) -> nn.Module:
    """`model` after `steps` full-batch Adam steps on the cross-entropy of (x, y), in place."""
    optimiser = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(steps):
        optimiser.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimiser.step()
    return model


def make(name: str, dtype=torch.float64, seed: int = 0):
    """(model in eval mode, x1, x2) for a named case."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    rand = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    if name == "mlp":
        model, x1, x2 = MLP(), rand(6, 5), rand(4, 5)
    elif name == "cnn":
        model, x1, x2 = CNN(), rand(5, 2, 6, 6), rand(3, 2, 6, 6)
    elif name == "transformer":
        model = TinyTransformer()
        x1 = torch.randint(0, 11, (5, 5), generator=g)
        x1[0, :2] = 0  # padding tokens
        x2 = torch.randint(0, 11, (3, 5), generator=g)
    elif name == "positions":  # N1 = sequence length, N2 ≠ it
        model = SharedPositions()
        x1 = torch.randint(0, 5, (3, 3), generator=g)
        x2 = torch.randint(0, 5, (2, 3), generator=g)
    elif name == "tied":
        model, x1, x2 = Tied(), rand(5, 4), rand(3, 4)
    elif name == "frozen":
        model, x1, x2 = Frozen(), rand(5, 5), rand(3, 5)
    elif name == "scalar":
        model, x1, x2 = Scalar(), rand(5, 5), rand(3, 5)
    elif name == "dict":
        model = DictInput()
        x1 = {"a": rand(5, 3), "b": rand(5, 2)}
        x2 = {"a": rand(3, 3), "b": rand(3, 2)}
    else:
        raise KeyError(name)
    return model.to(dtype).eval(), x1, x2


CASES = ("mlp", "cnn", "transformer", "positions", "tied", "frozen", "scalar", "dict")


class Parametrized(nn.Module):
    """Linear layers under torch.nn.utils.parametrizations (weight_norm, spectral_norm), whose
    weights are computed from parameters registered under `<layer>.parametrizations.weight`."""

    def __init__(self):
        super().__init__()
        parametrizations = nn.utils.parametrizations
        self.l1 = parametrizations.weight_norm(nn.Linear(5, 6))
        self.l2 = parametrizations.spectral_norm(nn.Linear(6, 6))
        self.out = nn.Linear(6, 3)

    def forward(self, x):
        return self.out(torch.relu(self.l2(torch.tanh(self.l1(x)))))
