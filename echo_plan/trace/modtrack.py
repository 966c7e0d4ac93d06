"""Labels recorded ops with the dotted name of the module that issued them.

Forward (and recompute): module pre/post hooks keep a stack of names. Backward: a hook on each
module's output gradient marks the start of that module's backward, and a hook on its input
gradient hands the label back to the parent, so backward ops are labelled too.
"""

from __future__ import annotations

import torch
from torch import nn

from echo_plan.trace.recorder import Recorder


def _grad_tensors(value) -> list[torch.Tensor]:
    items = value if isinstance(value, (tuple, list)) else (value,)
    return [t for t in items if isinstance(t, torch.Tensor) and t.requires_grad]


class ModuleLabeler:
    def __init__(self, root: nn.Module, recorder: Recorder) -> None:
        self.recorder = recorder
        self._stack: list[str] = []
        self._backward_label = ""
        for name, mod in root.named_modules():
            if not name:
                continue
            parent = name.rpartition(".")[0]
            mod.register_forward_pre_hook(self._pre(name, parent))
            mod.register_forward_hook(self._post(name))

    def _set_backward(self, label: str, only_from: str | None = None):
        """A gradient hook that labels what follows ``label`` (if the current label is ``only_from``)."""
        def hook(grad):
            if only_from is None or self.recorder.module == only_from:
                self._backward_label = label
                self.recorder.module = label
        return hook

    def _pre(self, name: str, parent: str):
        def hook(module, args):
            self._stack.append(name)
            self.recorder.module = name
            if torch.is_grad_enabled():
                for t in _grad_tensors(args):
                    t.register_hook(self._set_backward(parent, only_from=name))
        return hook

    def _post(self, name: str):
        def hook(module, args, output):
            if self._stack:
                self._stack.pop()
            self.recorder.module = self._stack[-1] if self._stack else self._backward_label
            if torch.is_grad_enabled():
                for t in _grad_tensors(output):
                    t.register_hook(self._set_backward(name))
        return hook
