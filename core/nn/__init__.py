"""Neural-network building blocks with torch.nn's names: Module, Parameter, layers, containers."""

from shoal.core.nn import functional
from shoal.core.nn import init
from shoal.core.nn import utils
from shoal.core.nn.attention import MultiheadAttention
from shoal.core.nn.containers import ModuleDict, ModuleList, ParameterDict, ParameterList, Sequential
from shoal.core.nn.conv import Conv1d, Conv2d, Conv3d, ConvTranspose1d, ConvTranspose2d, ConvTranspose3d
from shoal.core.nn.loss import (
    BCELoss, BCEWithLogitsLoss, CosineEmbeddingLoss, CrossEntropyLoss, GaussianNLLLoss,
    HingeEmbeddingLoss, HuberLoss, KLDivLoss, L1Loss, MarginRankingLoss, MSELoss, NLLLoss,
    PoissonNLLLoss, SmoothL1Loss, SoftMarginLoss, TripletMarginLoss,
)
from shoal.core.nn.layers import (
    GELU,
    Dropout,
    Embedding,
    EmbeddingBag,
    Identity,
    LayerNorm,
    Linear,
    ReLU,
    Sigmoid,
    Tanh,
)
from shoal.core.nn.module import IncompatibleKeys, Module, RemovableHandle, StateDictError
from shoal.core.nn.normalization import (
    BatchNorm1d, BatchNorm2d, GroupNorm, InstanceNorm1d, InstanceNorm2d, LocalResponseNorm, RMSNorm,
)
from shoal.core.nn import activations as _activations
from shoal.core.nn.activations import *  # noqa: F403 - its __all__: torch.nn's activation modules
from shoal.core.nn.parameter import Parameter
from shoal.core.nn.rnn import GRU, LSTM, RNN, RNNBase
from shoal.core.nn.rnn_cells import GRUCell, LSTMCell, RNNCell, RNNCellBase
from shoal.core.nn.pooling import AdaptiveAvgPool2d, AvgPool2d, Flatten, MaxPool2d
from shoal.core.nn.transformer import TransformerEncoder, TransformerEncoderLayer
from shoal.core.nn.fold import Fold, Unfold
from shoal.core.nn.transformer_decoder import (
    Transformer, TransformerDecoder, TransformerDecoderLayer,
)
from shoal.core.nn.upsampling import Upsample, UpsamplingBilinear2d, UpsamplingNearest2d
from shoal.core.nn.loss_margin_modules import (
    MultiLabelMarginLoss, MultiLabelSoftMarginLoss, MultiMarginLoss,
)

__all__ = [
    "GELU", "AdaptiveAvgPool2d", "AvgPool2d", "BatchNorm1d", "BatchNorm2d", "Conv1d", "Conv2d",
    "Dropout", "Embedding", "Flatten", "Identity", "IncompatibleKeys", "LayerNorm", "Linear",
    "MaxPool2d", "Module", "ModuleList", "MultiheadAttention", "Parameter", "ReLU",
    "RemovableHandle", "Sequential", "Sigmoid", "StateDictError", "Tanh", "TransformerEncoder",
    "TransformerEncoderLayer", "functional", "init", "utils",
    "CrossEntropyLoss", "MSELoss", "NLLLoss", "L1Loss", "SmoothL1Loss", "EmbeddingBag",
    "GRU", "LSTM", "RNN", "RNNBase", "GRUCell", "LSTMCell", "RNNCell", "RNNCellBase",
    "ModuleDict", "ParameterDict", "ParameterList", "BCELoss", "BCEWithLogitsLoss",
    "CosineEmbeddingLoss", "GaussianNLLLoss", "HingeEmbeddingLoss", "HuberLoss", "KLDivLoss",
    "MarginRankingLoss", "PoissonNLLLoss", "SoftMarginLoss", "TripletMarginLoss", "GroupNorm",
    "InstanceNorm1d", "InstanceNorm2d", "LocalResponseNorm", "RMSNorm",
    "Upsample", "UpsamplingBilinear2d", "UpsamplingNearest2d",
    "MultiLabelMarginLoss", "MultiLabelSoftMarginLoss", "MultiMarginLoss",
    "Fold", "Unfold",
    "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d",
    "Transformer", "TransformerDecoder", "TransformerDecoderLayer",
    *_activations.__all__,
]
