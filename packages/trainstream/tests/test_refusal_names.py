"""Every name a refusal tells the user to set (``name=`` in a raised message) exists: a wrap() option, a
parameter of a public trainstream function or class, or one of the few named below with where it lives. A
refusal that named an option nobody accepts (``wrap(quantize=...)`` once suggested ``train='lora'``) fails here."""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib
import re

import pytest
import trainstream

SOURCE = pathlib.Path(trainstream.__file__).parent
# Names in messages that are not trainstream parameters, and where the user meets them.
ELSEWHERE = {
    "amsgrad", "betas", "maximize", "weight_decay", "sparse",  # torch.optim.AdamW's and torch's own arguments
    "bf16", "gradient_accumulation_steps", "optimizers",  # transformers.Trainer / TrainingArguments
    "quant_method", "quantization_config", "dequantize", "num_beams",  # transformers' loading and generate()
    "use_vllm",  # TRL's GRPOConfig
    "step",  # the optimizer state's field (torch.optim.AdamW's state_dict format)
    "chunked_loss", "loss_chunk_size",  # TrainStreamTrainer's trainstream={...} keys
}


def _public_parameters() -> set[str]:
    names = set(trainstream.Config().options())
    modules = [trainstream]
    for name in ("trainstream.integrations.huggingface", "trainstream.integrations.trl"):
        try:
            modules.append(importlib.import_module(name))
        except ImportError:  # the integration's library is not installed here: its names are not checked
            continue
    for module in modules:
        for attr in getattr(module, "__all__", []):
            obj = getattr(module, attr)
            target = obj.__init__ if inspect.isclass(obj) else obj
            if callable(target):
                try:
                    names |= set(inspect.signature(target).parameters)
                except (TypeError, ValueError):
                    continue
            if inspect.isclass(obj):  # the methods users call on it (OffloadAdamW.attach, ...)
                for _, method in inspect.getmembers(obj, inspect.isfunction):
                    names |= set(inspect.signature(method).parameters)
    return names


def _named_in_refusals() -> dict[str, set[str]]:
    """name -> files, for each ``name=`` in a string of a raise statement of the package that is not a parameter
    of the function raising it (a check of that function's own argument names it rightly)."""
    found: dict[str, set[str]] = {}

    def visit(node, own: set[str], path: pathlib.Path) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            own = own | {a.arg for a in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]}
        if isinstance(node, ast.Raise) and node.exc is not None:
            for sub in ast.walk(node.exc):
                if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                    for match in re.finditer(r"(?<![\w.'\"])([a-z_][a-z0-9_]*)=(?!=)", sub.value):
                        if match.group(1) not in own:
                            found.setdefault(match.group(1), set()).add(path.relative_to(SOURCE).as_posix())
        for child in ast.iter_child_nodes(node):
            visit(child, own, path)

    for path in SOURCE.rglob("*.py"):
        visit(ast.parse(path.read_text()), set(), path)
    return found


def test_every_name_a_refusal_mentions_exists():
    pytest.importorskip("transformers")
    known = _public_parameters() | ELSEWHERE
    unknown = {name: sorted(files) for name, files in _named_in_refusals().items() if name not in known}
    assert not unknown, f"refusals name parameters that nothing accepts: {unknown}"


def test_the_scan_finds_the_refusals_it_checks():
    found = _named_in_refusals()
    assert {"max_grad_norm", "accumulation_steps", "param_offload", "quantize"} <= set(found)


def test_the_planners_advice_names_wrap_options():
    """ts-planner's advice reaches users in trainstream's refusals and `trainstream plan`: every ``name=`` in it
    is a wrap() option (it once said optimizer='host', streamed_blocks='auto', activations='recompute' and
    loss_chunk=1024, which wrap() does not take)."""
    from ts_planner import _decide

    options = set(trainstream.Config().options())
    texts = [*_decide._ADVICE.values(), *(advice for _, advice in _decide._ADVICE_TAKEN.values())]
    named = {m.group(1) for text in texts for m in re.finditer(r"(?<![\w.'\"])([a-z_][a-z0-9_]*)=(?!=)", text)}
    assert {"param_offload", "quantize", "offload"} <= named  # the scan sees them
    assert named <= options, sorted(named - options)
