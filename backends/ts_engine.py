"""The handler's model on OpenVINO's CPU runtime: its forward, not its handler code, on the fastest engine here.

build-repo copies this file beside the handler model's model.py (as ts_worker.py, it imports no module of ours).
The handler's own code runs as it is: only `handler.model`'s forward is taken over, and only once OpenVINO gave
that model's answers on a real batch of the handler's own inputs (within the build's tolerance, 1e-4 of the
largest output for fp32). Until then, and for any call that is not one float32 CPU tensor without gradients in
the shape it was converted for, the model's own forward runs (eager PyTorch, as under TorchServe).

The conversion (torch -> OpenVINO, ~9 s for ResNet-152 on 2 cores) runs in a thread on a copy of the model,
started by the first batch, so that no request waits for it.
"""
from __future__ import annotations

import copy
import threading

EAGER, OPENVINO = "eager", "openvino"


def accelerate(service, engine: str, hint: str, tolerance: float, report) -> str:
    """Hand the forward of the service's handler model to OpenVINO (from its first batch on, once checked);
    returns why not where it cannot ("" where it will try). report(message, warning) tells the log what came of it
    (from the conversion's thread)."""
    if engine != OPENVINO:
        return f"engine {engine}: the handler's model runs as TorchServe runs it"
    import torch

    handler = getattr(service._entry_point, "__self__", None)  # a handler class's handle(); a bare function has none
    model = getattr(handler, "model", None)
    reason = ""
    if not isinstance(model, torch.nn.Module):
        reason = "the handler has no torch model in self.model (a handle() function, or its own engine)"
    elif "pt2" in (getattr(handler, "model_yaml_config", None) or {}) or type(model).__name__ == "OptimizedModule":
        reason = "the archive compiles its model itself (pt2 in model-config.yaml)"
    elif any(p.device.type != "cpu" for p in model.parameters()):
        reason = "the model is not on the CPU"
    elif model.training:
        reason = "the model is in training mode"
    if reason:
        return reason
    forward = _Forward(model, hint, tolerance, report)
    try:
        object.__setattr__(model, "forward", forward)  # nn.Module.__call__ calls self.forward: ours now
    except (AttributeError, TypeError, RuntimeError) as exc:  # e.g. a ScriptModule's forward cannot be replaced
        return f"its forward cannot be replaced ({type(exc).__name__})"
    return ""


class _Forward:
    """The model's forward: its own until OpenVINO's is ready and checked, then OpenVINO's for the calls it fits."""

    def __init__(self, model, hint: str, tolerance: float, report):
        self.model, self.original = model, model.forward
        self.hint, self.tolerance, self.report = hint, tolerance, report
        self.state = "idle"  # -> converting -> ready | eager
        self.shape = None
        self.request = None
        self.thread = None

    def __deepcopy__(self, memo):  # the model's copy made for the conversion gets no forward of ours
        return None

    def __call__(self, *args, **kwargs):
        import torch

        fits = (len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor) and args[0].dtype == torch.float32
                and args[0].device.type == "cpu" and not torch.is_grad_enabled() and not self.model.training
                and args[0].dim() >= 1)
        if fits and self.state == "ready" and tuple(args[0].shape[1:]) == self.shape:
            result = self.request.infer({0: args[0].contiguous().numpy()})
            return torch.from_numpy(result[0].copy())  # a copy: the request's buffer is the next batch's
        output = self.original(*args, **kwargs)
        if fits and self.state == "idle" and isinstance(output, torch.Tensor) and output.dtype == torch.float32:
            self.state = "converting"
            self.shape = tuple(args[0].shape[1:])
            example, expected = args[0].detach().clone(), output.detach().clone()
            self.thread = threading.Thread(target=self._convert, args=(example, expected), daemon=True,
                                           name="openvino-convert")
            self.thread.start()
        return output

    def _convert(self, example, expected) -> None:
        try:
            import numpy as np
            import openvino as ov
            import torch

            clone = copy.deepcopy(self.model)
            clone.__dict__.pop("forward", None)  # None (__deepcopy__): the copy's class forward, not this object
            clone.eval()
            with torch.no_grad():
                converted = ov.convert_model(clone, example_input=(example,),
                                             input=[ov.PartialShape([-1, *example.shape[1:]])])
            del clone
            threads = torch.get_num_threads()  # the threads the eager forward used in this stub
            config = {"PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": "1", "INFERENCE_NUM_THREADS": str(threads)}
            if self.hint:  # else OpenVINO's choice for this CPU (--precision auto)
                config["INFERENCE_PRECISION_HINT"] = self.hint
            compiled = ov.Core().compile_model(converted, "CPU", config)
            if len(compiled.outputs) != 1:
                raise ValueError(f"{len(compiled.outputs)} outputs, not one tensor")
            request = compiled.create_infer_request()
            got = request.infer({0: example.contiguous().numpy()})[0]
            want = expected.numpy()
            scale = float(np.abs(want).max()) or 1.0
            error = float(np.abs(got - want).max()) / scale if got.shape == want.shape else float("inf")
            if not error <= self.tolerance:
                self.state = EAGER
                self.report(f"the handler's model stays on eager PyTorch: OpenVINO's answers on the first batch "
                            f"were {error:.3g} of the largest output away (allowed {self.tolerance:.0e})", True)
                return
            self.request = request
            self.state = "ready"
            chosen = compiled.get_property("INFERENCE_PRECISION_HINT")
            chosen = chosen.get_type_name() if hasattr(chosen, "get_type_name") else str(chosen)
            self.report(f"the handler's model runs on OpenVINO ({chosen}, {threads} threads) from now on: on the "
                        f"first batch {list(example.shape)} its answers were within {error:.2g} of the largest "
                        "output of eager PyTorch's", False)
        except Exception as exc:  # the conversion of the user's model: anything may come out of it
            self.state = EAGER
            first = (str(exc).strip().splitlines() or [""])[0]
            self.report(f"the handler's model stays on eager PyTorch: OpenVINO could not take it "
                        f"({type(exc).__name__}: {first})", True)
