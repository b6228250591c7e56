"""Forward hooks of the user's own: run at every step, which a captured graph cannot do.

A captured graph runs the hooks once, while it is traced, on fake tensors; what a hook keeps
(an activation appended to a list for a distillation loss or for logging, a statistic in a
dictionary) is then a traced value from the capture, and later steps add nothing. TorchDynamo's
graph-break path runs hooks as Python between or around its graphs, at every step, so a model
with such hooks trains there (:mod:`ortrain.ortmodule.graph_breaks`).

Hooks of PyTorch and of the libraries ortrain works with are captured as before: pruning's,
spectral and weight normalization's recompute a module's weight before its forward;
Hugging Face's (``enable_input_require_grads``, the recorders of hidden states and attentions)
act within the call; DeepSpeed ZeRO-3's are set aside while capturing
(:mod:`ortrain.ortmodule.zero3`).
"""

from __future__ import annotations

from torch import nn
from torch.nn.modules import module as torch_module

from ortrain.capture.module_hooks import has_users_hooks, is_users_hook

# Full backward (pre-)hooks of submodules count too (has_users_hooks): a graph traced with them
# ran them once, on traced gradients (a hook logging gradient norms saw one FunctionalTensor); one
# that only changes the gradient is differentiated correctly, one with side effects is not.


def user_forward_hooks(root: nn.Module) -> list[str]:
    """Where the user's forward (pre-)hooks and submodules' backward hooks are: submodule paths, and
    'every module' for global ones."""
    places = []
    global_hooks = (
        torch_module._global_forward_pre_hooks,
        torch_module._global_forward_hooks,
        torch_module._global_backward_pre_hooks,
        torch_module._global_backward_hooks,
    )
    if any(is_users_hook(h) for hooks in global_hooks for h in hooks.values()):
        places.append("every module (a global hook)")
    for name, module in root.named_modules():
        if has_users_hooks(module):
            places.append(name or type(root).__name__)
    return places
