"""torch.func's transforms: vmap, grad, grad_and_value, vjp, jvp, jacrev, jacfwd, hessian."""

from shoal.core.func.autodiff import grad, grad_and_value, jvp, vjp
from shoal.core.func import formulas  # noqa: F401 - registers create_graph formulas
from shoal.core.func.functional_call import functional_call, stack_module_state
from shoal.core.func.jacobians import hessian, jacfwd, jacrev
from shoal.core.func.vmap import vmap

__all__ = ["functional_call", "grad", "grad_and_value", "hessian", "jacfwd", "jacrev", "jvp",
           "stack_module_state", "vjp", "vmap"]
