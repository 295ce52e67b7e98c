"""torch.distributions' names over core: Normal, Uniform, Bernoulli, Categorical."""

from shoal.core.distributions import constraints
from shoal.core.distributions.bernoulli import Bernoulli
from shoal.core.distributions.categorical import Categorical
from shoal.core.distributions.distribution import Distribution
from shoal.core.distributions.normal import Normal
from shoal.core.distributions.uniform import Uniform

__all__ = ["Bernoulli", "Categorical", "Distribution", "Normal", "Uniform", "constraints"]
