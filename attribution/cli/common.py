"""What every subcommand shares: loading models and data, output formats, progress, errors.

Only click and the standard library are imported at module level: torch, numpy and the toolkit
are imported inside the functions that need them, so that `ntk --help` starts fast."""

from __future__ import annotations

import contextlib
import csv
import functools
import importlib
import importlib.util
import io
import json
import math
import os
import re
import shutil
import sys
import tempfile
import zipfile
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    import torch
    from torch import nn


class UsageProblem(click.ClickException):
    """A usage error (bad flag value, unreadable file, malformed spec): exit 2, one line."""

    exit_code = 2


class ModelFailure(click.ClickException):
    """The model's own forward pass failed (not its inputs, flags or files): exit 1, one line."""

    exit_code = 1


class OutputFailure(click.ClickException):
    """An output that could not be written once the work was done (a full disk, a file past
    the size limit, a permission lost since `check_paths` accepted it): neither bad input nor
    the model's fault, exit 1 as any other failure of the run, one line naming the flag and
    the path (the OSError of a write names neither)."""

    exit_code = 1


@contextlib.contextmanager
def writing(flag: str, path) -> Iterator[None]:
    """Around code that only writes the output `path` of `flag`: an OSError is `OutputFailure`
    ("--output out.json: cannot write: File too large")."""
    try:
        yield
    except OSError as exc:
        raise cannot_write(flag, path, exc) from None


@contextlib.contextmanager
def writing_into(flag: str, folder) -> Iterator[None]:
    """Around library code that writes the directory `folder` of `flag` among other work (a
    feature store, kernel tiles): an OSError naming a path in it (the library names the file of
    a failed write, `ntk.core.files.writes_to`) is `OutputFailure` ("STORE st: cannot write: No
    space left on device"); any other OSError (the model's, a read's) is left as it is."""
    try:
        yield
    except OSError as exc:
        if not isinstance(exc.filename, (str, bytes, os.PathLike)):
            raise
        root, file = Path(folder).resolve(), Path(os.fsdecode(exc.filename)).resolve()
        if file != root and root not in file.parents:
            raise
        raise cannot_write(flag, folder, exc) from None


def cannot_write(flag: str, path, exc: OSError) -> OutputFailure:
    """The one-line failure of `flag`'s output `path` that `exc` could not write, saying why
    without the errno and the file name: "--output out.json: cannot write: File too large"."""
    return OutputFailure(f"{flag} {path}: cannot write: {exc.strerror or _first_line(exc)}")


FORMATS = ("table", "json", "csv")
UNTRAINED = "untrained: no --weights"


def interactive() -> bool:
    return sys.stdout.isatty()


def warn(message: str) -> None:
    click.echo(f"ntk: warning: {message}", err=True)


def done(message: str) -> None:
    """One line on stderr saying what a command wrote besides its output (stdout stays the
    result, so that json and csv can be piped)."""
    click.echo(f"ntk: {message}", err=True)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def input_file(path: str, option: str) -> Path:
    """The file `path` given to `option`, refused unless it is one (missing, or a directory)."""
    file = Path(path)
    if file.is_dir():
        raise UsageProblem(f"{option}: {path} is a directory, not a file")
    if not file.is_file():
        raise UsageProblem(f"{option}: file {path} does not exist")
    return file


def load_object(spec: str, what: str = "model") -> Any:
    """Resolve `package.module:attr` (modules in the working directory included, as with
    `python -m`) or `path/to/file.py:attr`; any failure to import is a usage error naming the
    option."""
    if ":" not in spec:
        raise UsageProblem(
            f"--{what} must look like package.module:attr or path/file.py:attr, got {spec!r}"
        )
    target, attr = spec.rsplit(":", 1)
    if not attr.isidentifier():
        raise UsageProblem(f"--{what}: {attr!r} is not a valid attribute name")
    if target.endswith(".py"):
        path = input_file(target, f"--{what}")
    try:
        if target.endswith(".py"):
            module_spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            _working_directory_importable()
            module = importlib.import_module(target)
    except Exception as exc:
        raise UsageProblem(f"--{what}: cannot import {target}: {_first_line(exc)}") from None
    if not hasattr(module, attr):
        raise UsageProblem(f"--{what}: {target} has no attribute {attr!r}")
    return getattr(module, attr)


def _working_directory_importable() -> None:
    """Modules in the working directory importable by name, as with `python -m`."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())


def module_file(name: str) -> str | None:
    """The file that `import name` (package.module) would run, found the way the import system
    finds it (the working directory included, as `load_object` imports) but without importing
    anything: a package's __init__ is not run to find its submodules, so nothing heavy is loaded.
    None where no such file is found (a module that does not exist is left to the import to
    report; a built-in or namespace package has no file)."""
    parts = name.split(".")
    if not all(part.isidentifier() for part in parts):
        return None
    _working_directory_importable()
    spec, path = None, None
    for i in range(len(parts)):
        fullname = ".".join(parts[: i + 1])
        spec = getattr(sys.modules.get(fullname), "__spec__", None)
        if spec is None:
            try:  # each finder of the import system, given the parent package's folders
                found = (getattr(f, "find_spec", lambda *_: None) for f in sys.meta_path)
                spec = next((s for find in found if (s := find(fullname, path))), None)
            except Exception:  # a finder's own failure: the import will report it
                return None
        if spec is None:
            return None
        path = spec.submodule_search_locations
        if path is None and i < len(parts) - 1:  # not a package: it has no submodules
            return None
    return spec.origin if spec.has_location and spec.origin else None


def load_model(spec: str, weights: str | None = None, device: str | None = None) -> nn.Module:
    """Instantiate a model from a factory (or module instance) spec, load weights, eval mode."""
    from torch import nn

    obj = load_object(spec, "model")
    if isinstance(obj, nn.Module) or not callable(obj):
        model = obj
    else:
        try:
            model = obj()
        except Exception as exc:
            raise UsageProblem(f"--model: {spec}() raised {_first_line(exc)}") from None
    if not isinstance(model, nn.Module):
        raise UsageProblem(f"--model: {spec} is neither an nn.Module nor a factory returning one")
    if weights is not None:
        load_weights(model, weights)
    if device is not None:
        model = model.to(device)
    return model.eval()


def _load_failure(exc: BaseException, weights: bool = False) -> str:
    """Why torch.load refused a file, without torch's advice to load it with weights_only=False
    (unsafe for a file of unknown origin, and useless for one that is not a torch file); its
    parser's own failure (KeyError: 101 on text, EOFError on an empty file) says what it is.
    weights: the file was given as weights (a pickled class is most likely a whole model)."""
    if "weights_only" in str(exc):
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(exc))
        if found:  # the unpickler names the first class it refused (it never imports it)
            advice = (
                "a whole model saved with torch.save(model)? save its weights with "
                "torch.save(model.state_dict(), path)"
                if weights
                else "save torch tensors, or numpy arrays in an .npz"
            )
            return f"it holds a pickled {found[1]}, a Python object, which is not loaded ({advice})"
        return (
            "not a file of tensors written by torch.save (or it holds Python objects, which "
            "are not loaded)"
        )
    if isinstance(exc, OSError):
        return _first_line(exc)
    return f"not a file written by torch.save, or a truncated one ({_first_line(exc)})"


def load_weights(model: nn.Module, weights: str, option: str = "--weights") -> None:
    """Load a state_dict file into `model`; a checkpoint that does not fit names the tensors and
    shapes (errors name the command-line `option` the file came from)."""
    import torch

    path = input_file(weights, option)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise UsageProblem(
            f"{option}: cannot read {weights}: {_load_failure(exc, weights=True)}"
        ) from None
    state = _state_dict_in(state, option, weights)
    own = model.state_dict()
    for prefix, origin in _SAVED_PREFIXES:  # the wrapper's own prefix on every key
        if state and not own.keys() & state.keys() and all(k.startswith(prefix) for k in state):
            stripped = {k.removeprefix(prefix): v for k, v in state.items()}
            if stripped.keys() == own.keys():
                warn_later(
                    f"{option}: {weights} names its tensors {prefix}… ({origin}): read as "
                    "the model's own"
                )
                state = stripped
                break
    problems = [
        f"tensor {k!r} is {list(state[k].shape)} in the file but {list(v.shape)} in the model"
        for k, v in own.items()
        if k in state and state[k].shape != v.shape
    ]
    problems += [f"tensor {k!r} is missing from the file" for k in own if k not in state]
    problems += [f"the file has tensor {k!r}, which the model lacks" for k in state if k not in own]
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise UsageProblem(f"{option}: {weights} does not fit the model: {problems[0]}{more}")
    try:
        model.load_state_dict(state)
    except (RuntimeError, TypeError, ValueError) as exc:
        details = [line.strip() for line in str(exc).splitlines() if line.strip()]
        raise UsageProblem(
            f"{option}: {weights} does not fit the model: {details[-1] if details else exc}"
        ) from None


# key prefixes of state_dicts saved from a wrapper of the model, and the wrapper
_SAVED_PREFIXES = (
    ("module.", "saved from DataParallel or DistributedDataParallel"),
    ("_orig_mod.", "saved from torch.compile's wrapper"),
)
# the entries of a training checkpoint that hold the model's weights (tutorials, Lightning)
_CHECKPOINT_ENTRIES = ("state_dict", "model_state_dict", "model")


def _state_dict_in(saved, option: str, weights: str) -> dict:
    """The state_dict (name → tensor) in a loaded file: the file itself, or the entry of a
    training checkpoint ({"model_state_dict": ..., "epoch": ...}) that holds one."""
    import torch

    def tensors(value) -> bool:
        return isinstance(value, dict) and all(isinstance(v, torch.Tensor) for v in value.values())

    if tensors(saved):
        return saved
    if isinstance(saved, dict):
        for entry in _CHECKPOINT_ENTRIES:
            if tensors(saved.get(entry)):
                return saved[entry]
        keys = ", ".join(repr(k) for k in list(saved)[:6]) + (", …" if len(saved) > 6 else "")
        raise UsageProblem(
            f"{option}: {weights} does not hold a state_dict of tensors: a dict of {keys}, and "
            f"no entry {' / '.join(map(repr, _CHECKPOINT_ENTRIES))} holding one"
        )
    raise UsageProblem(
        f"{option}: {weights} does not hold a state_dict of tensors (a {type(saved).__name__})"
    )


def load_output_fn(spec: str | None) -> Callable | None:
    """--output-fn: None, the name of a field of the model's output (an attribute, or a key of
    a dict output: `logits` for HuggingFace models), or package.module:function /
    path/file.py:function."""
    if spec is None:
        return None
    if ":" in spec:
        fn = load_object(spec, "output-fn")
        if not callable(fn):
            raise UsageProblem(f"--output-fn: {spec} is not callable")
        return OutputFn(fn, spec)
    if not spec.isidentifier():
        raise UsageProblem(
            "--output-fn must be a field name (e.g. logits), package.module:function or "
            f"path/file.py:function, got {spec!r}"
        )
    return OutputFn(functools.partial(_field, name=spec), spec)


def _field(out, name: str):
    """The field `name` of a model's output: a key of a dict output, else an attribute
    (HuggingFace's ModelOutput is both)."""
    if isinstance(out, Mapping):
        if name in out:
            return out[name]
        if not hasattr(out, name):
            raise KeyError(f"no key {name!r} (its keys: {', '.join(map(repr, out))})")
    return getattr(out, name)


class OutputFn:
    """--output-fn: a failure on the model's output (a misspelt attribute, a field the model
    leaves None) is bad input naming the flag, not an error from inside the library."""

    def __init__(self, fn: Callable, spec: str):
        self.fn, self.spec = fn, spec

    def __str__(self) -> str:
        return self.spec

    def __call__(self, out):
        try:
            result = self.fn(out)
        except Exception as exc:
            raise ValueError(
                f"--output-fn {self.spec} failed on the model's output (a "
                f"{type(out).__name__}): {type(exc).__name__}: {exc}"
            ) from exc
        if result is None:
            raise ValueError(
                f"--output-fn {self.spec} gave None for the model's output (a "
                f"{type(out).__name__}); name the field that holds the logits"
            )
        return result


def load_arrays(
    path: str, option: str = "data", labels: bool = True
) -> tuple[Any, torch.Tensor | None]:
    """Inputs `x` and optional labels `y` from an .npz or .pt file. `x` is one array, or several
    model inputs passed by keyword: arrays named x.<name> (e.g. x.input_ids and
    x.attention_mask), or in a .pt file a dict of tensors under x. labels=False: y, whatever it
    holds, is only checked to have one entry per sample, and None is returned for it."""
    import numpy as np
    import torch

    from ntk.core import inputs

    file = input_file(path, f"--{option}")
    if file.suffix not in (".npz", ".pt"):
        raise UsageProblem(f"--{option}: {path} must be an .npz or .pt file")
    try:
        if file.suffix == ".npz":
            if not zipfile.is_zipfile(file):
                raise UsageProblem(
                    f"--{option}: {path} is not an .npz archive (write one with numpy.savez)"
                )
            with np.load(file, allow_pickle=False) as z:
                content = {k: z[k] for k in z.files}
        else:
            try:
                content = torch.load(file, map_location="cpu", weights_only=True)
            except Exception as exc:
                raise UsageProblem(
                    f"--{option}: cannot read {path}: {_load_failure(exc)}"
                ) from None
            if isinstance(content, torch.Tensor):
                content = {"x": content}
    except UsageProblem:
        raise
    except ValueError as exc:
        if "pickle" in str(exc):  # numpy's advice to load untrusted data unsafely is not ours
            raise UsageProblem(
                f"--{option}: {path} holds Python objects (pickled data), which are not loaded; "
                "save plain numeric arrays"
            ) from None
        raise UsageProblem(f"--{option}: cannot read {path}: {_first_line(exc)}") from None
    except Exception as exc:
        raise UsageProblem(f"--{option}: cannot read {path}: {_first_line(exc)}") from None
    named = (
        {}
        if not isinstance(content, dict)
        else {k[2:]: v for k, v in content.items() if k.startswith("x.")}
    )
    if not isinstance(content, dict) or ("x" not in content and not named):
        raise UsageProblem(
            f"--{option}: {path} must hold an array named 'x' and optionally 'y'; for a model "
            "taking keyword inputs, arrays x.<name> (x.input_ids, x.attention_mask) or, in a .pt "
            "file, a dict {'x': {name: tensor}, 'y': labels}"
        )
    read = {"x", "y"} if "x" in content else {"y", *(f"x.{k}" for k in named)}
    ignored = [repr(k) for k in content if k not in read]
    if ignored:
        warn_later(
            f"--{option}: {path} holds arrays that are not read: {', '.join(ignored)} (read: x, or "
            "x.<name> for keyword inputs, and y)"
        )
    x = content["x"] if "x" in content else named
    try:  # floating arrays keep their dtype until the model's is known (`in_model_dtype`)
        x = (
            {k: torch.as_tensor(v) for k, v in x.items()}
            if isinstance(x, dict)
            else torch.as_tensor(x)
        )
        y = content.get("y")
        y = None if y is None else inputs.targets(y) if labels else np.asarray(y)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise UsageProblem(f"--{option}: {path}: {_first_line(exc)}") from None
    if isinstance(x, torch.Tensor) and (x.dim() == 0 or len(x) == 0):
        raise UsageProblem(f"--{option}: {path} holds no samples (x has shape {tuple(x.shape)})")
    try:
        n = inputs.validate(x, "x")
    except (TypeError, ValueError) as exc:
        raise UsageProblem(f"--{option}: {path}: {exc}") from None
    if y is not None and (y.ndim == 0 or len(y) != n):
        raise UsageProblem(f"--{option}: x has {n} samples but y has shape {tuple(y.shape)}")
    return x, y if labels else None


class TwoClassScores:
    """The class scores [0, z] of a binary classifier's one logit z (the model's output, or what
    `inner`, the --output-fn, makes of it): `attribution.outputs.two_class_logits`, named for
    the report's settings."""

    def __init__(self, inner: Callable | None):
        self.inner = inner

    def __call__(self, out):
        from ..outputs import two_class_logits

        return two_class_logits(self.inner, out)

    def __str__(self) -> str:
        return f"[0, z] of the one logit z of {self.inner or 'the model'}"


def binary_logit(model: nn.Module, x, y, option: str, output_fn: Callable | None):
    """`TwoClassScores` of output_fn, with a warning saying so, for a model that gives one output
    per sample on --option's x while its labels y are 0 and 1 (a binary classifier's logit);
    output_fn as it is otherwise (`class_labels` then refuses a model of one output)."""
    import numpy as np
    import torch

    from ntk.core import inputs

    from ..outputs import logits

    one = logits(model, inputs.take(x, slice(0, 1)), output_fn=output_fn, name=f"--{option}: x")
    if one.shape[1] != 1 or y is None:
        return output_fn
    values = y.detach().cpu().numpy() if isinstance(y, torch.Tensor) else np.asarray(y)
    if values.dtype.kind not in "biuf" or not set(np.unique(values).tolist()) <= {0, 1}:
        return output_fn
    warn_later(
        f"the model gives one output per sample and --{option}'s labels are 0 and 1: it is read "
        "as a binary classifier's logit z, with class scores [0, z] (class 1's probability σ(z))"
    )
    return TwoClassScores(output_fn)


def class_labels(model: nn.Module, x, y, option: str, output_fn: Callable | None):
    """Labels y of --option's file checked as class labels of the model's outputs (None stays
    None), before any work; errors name the flag. A model of one output is refused whatever y
    holds (a regression model, or a binary classifier with one logit, which --output-fn can turn
    into two class scores)."""
    from ntk.core import inputs
    from ntk.core.kinds import ONE_LOGIT

    from ..outputs import labels, logits

    one = logits(model, inputs.take(x, slice(0, 1)), output_fn=output_fn, name=f"--{option}: x")
    if one.shape[1] < 2:  # the remedy's output_fn is printed as the --output-fn flag (`main`)
        command = click.get_current_context().info_name
        raise UsageProblem(
            f"ntk {command} needs a classifier with at least two outputs (class scores); the "
            f"model has {one.shape[1]} output: a regression model is not supported, and "
            f"{ONE_LOGIT}"
        )
    if y is None:
        return None
    try:
        return labels(y, inputs.count(x), one.shape[1], f"--{option}: y")
    except (TypeError, ValueError) as exc:
        raise UsageProblem(str(exc)) from None


@contextlib.contextmanager
def flag_names(**names: str):
    """Library errors that start with an argument's name (alone or after a prefix such as
    "candidate 'a': ") name what the user gave instead: flag_names(image_shape="--image-shape").
    Bad input (TypeError, ValueError) and a model that fails on some samples of the data
    (`ntk.core.model.ModelForwardError`, whose message names the library's argument, e.g. x1)."""
    try:
        yield
    except Exception as exc:
        model = sys.modules.get("ntk.core.model")  # loaded by any command that ran a model
        if model is not None and isinstance(exc, model.ModelForwardError):
            # the model's fault on a sample past the one `check_fits` ran, said as it says it
            argument = re.match(rf"({'|'.join(map(re.escape, names))}): ", str(exc))
            if argument:
                raise ModelFailure(
                    f"{str(exc)[argument.end() :]} (on {names[argument[1]]})"
                ) from None
            raise
        if not isinstance(exc, (TypeError, ValueError)):
            raise
        pattern = rf"(^|: )({'|'.join(map(re.escape, names))})\b"
        exc.args = (re.sub(pattern, lambda m: m[1] + names[m[2]], str(exc)),)
        raise


def spec_file(spec: str | None) -> str | None:
    """The source file that a path/file.py:attr or package.module:attr spec (--model,
    --candidates, --output-fn) reads (`module_file`, found without importing), else None."""
    if spec is None or ":" not in spec:  # not a spec (load_object says so), or an attribute name
        return None
    target = spec.rsplit(":", 1)[0]
    return target if target.endswith(".py") else module_file(target)


def model_files(model_spec, weights, data, option: str = "--data", *, output_fn) -> list:
    """(flag, path) of the files that --model (a .py file or a module's), --weights, --data (or
    the flag `option` that gave the data) and --output-fn (a file.py:fn or package.module:fn
    spec; an attribute name such as logits reads no file) read, for `check_paths`."""
    return [
        ("--model", spec_file(model_spec)),
        ("--weights", weights),
        (option, None if data == "digits" else data),
        ("--output-fn", spec_file(output_fn)),
    ]


def check_paths(
    files: Sequence[tuple[str, str | None]],
    reads: Sequence[tuple[str, str | None]] = (),
    directories: Sequence[tuple[str, str | None]] = (),
    renamed: Collection[str] = (),
) -> None:
    """Refuse, before any work, the outputs a command cannot write or would lose something to:
    each (flag, path) of `files` and `directories` it writes (None: not given) must be writable
    (its directory exists and takes new files; a file no directory, a directory no file; the
    files of the flags in `renamed`, written to a temporary file renamed onto the path, not an
    existing device or other file that is not a regular one, which the rename would replace), and no
    written path may be, hold or lie inside another written path or a path it reads (`reads`:
    --data, --weights, a store, ...), compared as resolved paths. Errors name both flags."""
    written = [(flag, path, False) for flag, path in files if path is not None]
    written += [(flag, path, True) for flag, path in directories if path is not None]
    for flag, path, directory in written:
        _check_writable(flag, path, directory)
        if flag in renamed:
            from ntk.core.files import check_replaceable

            try:
                check_replaceable(path, flag)
            except ValueError as exc:
                raise UsageProblem(str(exc)) from None
    entries = [(flag, path, True) for flag, path, _ in written]
    entries += [(flag, path, False) for flag, path in reads if path is not None]
    resolved = [Path(path).resolve() for _, path, _ in entries]
    for i, (flag, path, writes) in enumerate(entries):
        for j in range(min(i, len(written))):  # each path against the written ones before it
            other, there, _ = entries[j]
            if resolved[i] == resolved[j]:
                raise UsageProblem(
                    f"{other} and {flag} both name {path}: each output needs a path of its own"
                    if writes
                    else f"{other} {there} is the input of {flag}; an output must not overwrite it"
                )
            if resolved[j] in resolved[i].parents or resolved[i] in resolved[j].parents:
                inner, outer = (i, j) if resolved[j] in resolved[i].parents else (j, i)
                raise UsageProblem(
                    f"{entries[inner][0]} {entries[inner][1]} lies inside {entries[outer][0]} "
                    f"{entries[outer][1]}, a directory this command "
                    f"{'writes' if entries[outer][2] else 'reads'}; name a path outside it"
                )


def _check_writable(flag: str, path: str, directory: bool) -> None:
    """`check_paths` for one output: a file or directory that can be created or replaced. An
    existing directory (a store resumed) or device (/dev/null) is judged by its permissions, any
    other path by a trial file in its directory (root is permitted everything, but /proc or a
    read-only mount take no files), that of the file a symlink names (written through it)."""
    target = Path(path)
    if directory and target.exists() and not target.is_dir():
        raise UsageProblem(f"{flag}: {path} is a file, not a directory")
    if not directory and target.is_dir():
        raise UsageProblem(f"{flag}: {path} is a directory, not a file")
    if target.exists() and not target.is_file():  # no trial file where other ranks list a store
        if not os.access(target, os.W_OK | (os.X_OK if directory else 0)):
            raise UsageProblem(f"{flag}: {path} is not writable")
        return
    from ntk.core.files import written_path

    folder = written_path(target).parent
    if folder.exists() and not folder.is_dir():
        raise UsageProblem(f"{flag}: cannot write {path}: {folder} is not a directory")
    if not folder.is_dir():
        raise UsageProblem(f"{flag}: directory {folder} does not exist (for {path})")
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError:
        raise UsageProblem(
            f"{flag}: cannot write {path}: directory {folder} is not writable"
        ) from None


@dataclass(frozen=True)
class Output:
    """Where and how a subcommand writes its result (--format, --output, --all, --columns)."""

    fmt: str = "table"
    path: str | None = None
    all_columns: bool = False
    columns: tuple[str, ...] = ()


def output_options(
    columns: Sequence[str] | Callable[[dict], Sequence[str]],
    describe: str = "",
    headers: Mapping[str, str] | None = None,
):
    """--format, --output, --all and --columns, passed to the command as one `out: Output`.
    columns: the columns of the command's rows, or a function of the command's other parameters
    (by name) giving them; --columns is checked against them before any work, and its help
    lists them (or says `describe`). headers: the table's headers that differ from the names
    (condition_number: κ), listed beside them and accepted in their place."""
    valid = columns  # the command's own parameter is called `columns` too
    headers = headers or {}

    def decorate(f):
        @functools.wraps(f)
        def command(*args, fmt, output, all_columns, columns: str | None, **kwargs):
            chosen = tuple(c.strip() for c in columns.split(",") if c.strip()) if columns else ()
            if all_columns and chosen:
                raise UsageProblem("--all and --columns exclude each other")
            chosen = check_columns(chosen, valid(kwargs) if callable(valid) else valid, headers)
            return f(*args, out=Output(fmt, output, all_columns, chosen), **kwargs)

        options = [
            click.option(
                "--format", "fmt", type=click.Choice(FORMATS), default="table", show_default=True
            ),
            click.option(
                "--output", default=None, help="write the result to this file instead of stdout"
            ),
            click.option(
                "--all",
                "all_columns",
                is_flag=True,
                help="table: show every column (json and csv always hold every column)",
            ),
            click.option(
                "--columns",
                default=None,
                help="table: the columns to show, comma-separated, of "
                + (describe or column_names(valid, headers)),
            ),
        ]
        for option in reversed(options):
            command = option(command)
        return command

    return decorate


def column_names(columns: Sequence[str], headers: Mapping[str, str] | None = None) -> str:
    """The columns' names for help and errors, each with its table header where that differs:
    "kind, lambda_1 (λ1), condition_number (κ)"."""
    headers = headers or {}
    return ", ".join(f"{c} ({headers[c]})" if headers.get(c, c) != c else c for c in columns)


def check_columns(
    chosen: Sequence[str], available: Sequence[str], headers: Mapping[str, str] | None = None
) -> tuple[str, ...]:
    """--columns: every chosen column is one of `available`, by its name or its table header
    (`headers`); returns their names."""
    names = {h: c for c, h in (headers or {}).items() if c in available}
    chosen = tuple(names.get(c, c) for c in chosen)
    unknown = [c for c in chosen if c not in available]
    if unknown:
        raise UsageProblem(
            f"--columns: no column {unknown[0]!r}; the columns are "
            f"{column_names(available, headers)}"
        )
    return chosen


def emit(
    rows: Sequence[dict],
    out: Output,
    *,
    title: str = "",
    meta: dict | None = None,
    columns: Sequence[str] | None = None,
    headers: dict[str, str] | None = None,
    notes: Sequence[str] = (),
    display: dict[str, Callable[[Any], str]] | None = None,
    append: bool = False,
    untrained: bool | None = None,
) -> None:
    """Write rows as JSON or CSV (every column; in CSV the union of the rows' columns, blank
    where a row has none), or as a table of `columns` (default: all) that fits the console:
    numbers in at most 9 characters, and a table wider than the console is folded into one
    block per row rather than cut. `headers` relabel columns in the table only, as `display` maps
    the values of some columns (e.g. the root module's layer name "" to "(root)"); `notes` are
    printed under it. append: a second table after a first one in the same --output file.
    untrained: whether a --model runs without --weights (`untrained_note`; None for commands
    without --model): the title ends with "[untrained: no --weights]", JSON holds "untrained"."""
    if untrained is not None:
        meta = {**(meta or {}), "untrained": untrained}
        title += f" [{UNTRAINED}]" if untrained else ""
    if out.fmt in ("json", "csv"):
        if out.fmt == "json":
            payload = _json_ready({**(meta or {}), "rows": list(rows)})
            text = json.dumps(payload, indent=2, allow_nan=False)
            text += "\n"
        else:
            buf = io.StringIO()
            fields = list(dict.fromkeys(k for row in rows for k in row))
            writer = csv.DictWriter(buf, fields, lineterminator="\n")
            writer.writeheader()
            writer.writerows(rows)
            text = buf.getvalue()
        if out.path:
            with output_file(out.path) as f:
                f.write(text)
        else:
            click.echo(text, nl=False)
        return
    from rich.console import Console

    available = list(rows[0]) if rows else list(columns or ())
    chosen = list(out.columns) or (available if out.all_columns or columns is None else columns)
    check_columns(chosen, available, headers)  # before any work too, where they are known
    if display:
        rows = [{k: display[k](v) if k in display else v for k, v in row.items()} for row in rows]
    hidden = [c for c in available if c not in chosen]
    if hidden:
        notes = [*notes, f"{len(hidden)} more columns with --all or --columns, or in json/csv"]
    with contextlib.ExitStack() as stack:
        if out.path:
            f = stack.enter_context(output_file(out.path, append=append))
            console = Console(file=f, width=120, color_system=None)
        else:
            console = Console(color_system="auto" if interactive() else None)
        _print_table(console, rows, chosen, title, headers or {}, notes)


@contextlib.contextmanager
def output_file(path, *, append: bool = False):
    """--output open for writing text, written through `output_path` (a temporary file renamed
    onto `path` once complete; in place where `path` is a device). append: after what `path`
    holds (a second table of one command), copied into the temporary file first."""
    target = Path(path)
    with output_path("--output", path) as where:
        if append and where != target and target.exists():
            shutil.copyfile(target, where)
        with open(where, "a" if append else "w") as f:
            yield f


@contextlib.contextmanager
def output_path(flag: str, path) -> Iterator[Path]:
    """The path to write `flag`'s output file `path` to: a temporary file renamed onto `path`
    once complete (`atomic_path`), so that a failure part-way (a full disk, an interrupt, an
    error while rendering) leaves no file, or the earlier one as it was, rather than a partial
    file under that name; `path` itself where it exists and is not a regular file (/dev/null, a
    pipe), which the rename would replace. A failure to write (OSError) names `flag` and `path`
    (`writing`)."""
    target = Path(path)
    if target.exists() and not target.is_file():
        with writing(flag, path):
            yield target
        return
    from ntk.core.files import atomic_path

    with writing(flag, path), atomic_path(target) as tmp:
        yield tmp


def _print_table(console, rows, shown, title, headers, notes) -> None:
    """Every text is a rich `Text`, so that brackets in names or titles are not taken as markup."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for column in shown:
        numeric = bool(rows) and isinstance(rows[0][column], (int, float))
        table.add_column(
            Text(headers.get(column, column)), justify="right" if numeric else "left", no_wrap=True
        )
    cells = [[cell(row[c]) for c in shown] for row in rows]
    for line in cells:
        table.add_row(*map(Text, line))
    if title:
        console.print(Text(title))
    from rich.measure import Measurement

    natural = Measurement.get(console, console.options.update_width(1 << 20), table).maximum
    if natural <= console.width:
        console.print(table)
    else:  # fold: one block per row, each value on its own line, nothing cut
        console.print()
        for line in cells:
            grid = Table.grid(padding=(0, 2))
            grid.add_column(no_wrap=True)
            grid.add_column(overflow="fold")
            for column, value in zip(shown, line):
                grid.add_row(Text(headers.get(column, column)), Text(value))
            console.print(grid)
            console.print()
    for note in notes:
        console.print(Text(note))


def cell(value) -> str:
    """A table cell: floats in at most 9 characters (4 significant digits, short exponent)."""
    if value is None:
        return "–"
    if not isinstance(value, float):
        return str(value)
    if value == 0 or not math.isfinite(value):
        return "0" if value == 0 else str(value)
    text = f"{value:.4g}"
    if abs(value) >= 1e-3 and "e" not in text:
        return text
    for digits in (3, 2):
        mantissa, exponent = f"{value:.{digits}e}".split("e")
        text = f"{mantissa}e{int(exponent)}"
        if len(text) <= 9:
            return text
    return text


def _json_ready(value):
    """Plain JSON values: numpy scalars and tensors as numbers and lists, and non-finite floats
    (a rank-deficient kernel's κ = inf) as null, which every JSON parser reads (Infinity is
    not JSON)."""
    import numpy as np
    import torch

    if isinstance(value, dict):
        return {k: _json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_ready(v) for v in value]
    if isinstance(value, torch.Tensor):
        return _json_ready(value.tolist())
    if isinstance(value, (np.floating, np.integer, np.bool_)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise TypeError(f"cannot write {type(value).__name__} as JSON")


@contextlib.contextmanager
def step(text: str):
    """A spinner on stderr while a step without its own progress bar runs (terminals only)."""
    if not sys.stderr.isatty():
        yield
        return
    from rich.console import Console

    with Console(stderr=True).status(text):
        yield


def check_device(ctx, param, value: str | None) -> str | None:
    """--device: a torch device this machine has (the library's `resolve_device` decides),
    refused before any work otherwise."""
    if value is None:
        return None
    import torch

    from ntk.core.model import resolve_device

    try:
        device = torch.device(value)
    except RuntimeError:
        raise click.BadParameter(
            f"{value!r} is not a torch device (e.g. cpu, cuda, cuda:1, mps)"
        ) from None
    try:
        resolve_device(device)
    except ValueError:
        backend = getattr(torch, device.type, None)
        count = getattr(backend, "device_count", lambda: 0)() if backend is not None else 0
        raise click.BadParameter(
            f"{value}: this machine has {count or 'no'} {device.type} device(s)"
        ) from None
    return value


DEVICE_OPTION = click.option(
    "--device", default=None, callback=check_device, help="torch device, e.g. cpu or cuda"
)


def model_options(
    columns: Sequence[str] | Callable[[dict], Sequence[str]],
    describe: str = "",
    headers: Mapping[str, str] | None = None,
):
    """--model, --weights, --data, --samples, --device, --output-fn, --batch-size and
    `output_options(columns, describe, headers)`."""
    return functools.partial(_model_options, output_options(columns, describe, headers))


def _model_options(output: Callable, f):
    options = [
        click.option(
            "--model",
            "model_spec",
            default=None,
            help="package.module:factory or path/file.py:factory "
            "(default: the built-in digits demo); it runs in eval mode (Dropout off, "
            "BatchNorm's running statistics)",
        ),
        click.option(
            "--weights", default=None, help="state_dict file (.pt), loaded with weights_only=True"
        ),
        click.option(
            "--data",
            default="digits",
            show_default=True,
            help="'digits' or an .npz/.pt file with arrays x (and optionally y); keyword "
            "inputs as arrays x.<name> (x.input_ids, ...) or a .pt dict {'x': {...}, 'y': ...}",
        ),
        click.option(
            "--samples", type=click.IntRange(min=1), default=None, help="use the first N samples"
        ),
        DEVICE_OPTION,
        click.option(
            "--output-fn",
            default=None,
            help="map the model's output to [B, O]: a field name (an attribute or a dict key, "
            "e.g. logits for HuggingFace models), package.module:function or "
            "path/file.py:function",
        ),
        click.option(
            "--batch-size",
            type=click.IntRange(min=1),
            default=None,
            help="samples per block (default: chosen from free memory)",
        ),
    ]
    f = output(f)
    for option in reversed(options):
        f = option(f)
    return f


# The sample budget of a run: all 1,000 training samples of the demo (`ntk kernel`, whose full
# kernel costs O((N·O)³), takes fewer); every section says how many samples it used.
DEMO_SAMPLES = 1000


@functools.lru_cache(maxsize=1)
def demo_model():
    """The trained demo network and its data, trained once per process (a progress bar on a
    terminal)."""
    from ntk import demo

    return demo.demo_model(progress=sys.stderr.isatty())


def resolve_model_and_data(
    model_spec,
    weights,
    data,
    samples,
    device,
    default_samples: int | None = DEMO_SAMPLES,
    option: str = "data",
    labels: bool = True,
):
    """The model and (x, y) a subcommand works on; no --model means the trained demo network.
    option: the command-line name of `data` in errors; labels=False: y is not used (None; only
    its length is checked)."""
    if model_spec is None:
        if weights is not None:
            raise UsageProblem("--weights needs --model")
        if data != "digits":
            raise UsageProblem(
                "--data with a file needs --model (the built-in demo runs on digits)"
            )
        model, digits = demo_model()
        model = model.to(device) if device else model
        x, y = digits.x_train, digits.y_train
    else:
        if data != "digits":
            x, y = load_arrays(data, option, labels)
        model = load_model(model_spec, weights, device)
        if data == "digits":
            from ntk import demo

            d = demo.digits()
            x, y = d.x_train, d.y_train
    from ntk.core import inputs

    n = samples or default_samples
    total = inputs.count(x)
    if samples is None and n is not None and total > n and data != "digits":
        warn_later(
            f"using the first {n} of the {total} samples of --{option} (--samples N to change)"
        )
    more_than_held("samples", total, option)
    x, y = inputs.take(x, slice(0, n)), (None if y is None else y[:n])
    x = in_model_dtype(model, x, option)
    check_fits(model, x, option)
    return model, x, y


def more_than_held(parameter: str, total: int, option: str) -> None:
    """Warn (`warn_later`) when the command line asks for more samples (--samples,
    --test-samples) than --option holds: all of them are used, fewer than asked."""
    from click.core import ParameterSource

    ctx = click.get_current_context()
    asked = ctx.params.get(parameter)
    if asked is None or asked <= total:
        return
    if ctx.get_parameter_source(parameter) in (
        ParameterSource.COMMANDLINE,
        ParameterSource.ENVIRONMENT,
    ):
        flag = "--" + parameter.replace("_", "-")
        kept = ctx.params.get("samples") if parameter != "samples" else None
        if kept is not None and kept == total and option != "test":  # --samples cut --option
            held = f"--samples {kept} keeps only {total} samples of --{option}"
        else:
            held = f"--{option} holds only {total} samples"
        warn_later(f"{flag} {asked}: {held}; using all {total}")


def in_model_dtype(model: nn.Module | None, x, option: str):
    """x with its floating tensors in the dtype of the model's parameters (torch's default
    without a model): a float64 model gets float64 inputs, a float32 one float32 inputs whatever
    the file holds; integer tensors such as token ids stay. Values beyond the range of that
    dtype are refused, naming --option."""
    import torch

    from ntk.core import inputs

    first = None if model is None else next(model.parameters(), None)
    dtype = torch.get_default_dtype() if first is None else first.dtype
    converted = inputs.convert(x, None, dtype if dtype.is_floating_point else None)
    try:
        inputs.validate(converted, "x")
    except ValueError:  # finite before: too large for `dtype`
        raise UsageProblem(
            f"--{option}: x holds values too large for the model's dtype {dtype} (they become inf)"
        ) from None
    return converted


_LATER = "ntk.warnings_after_checks"  # click's per-invocation meta key of `warn_later`


def warn_later(message: str) -> None:
    """A warning printed once the inputs are checked (by `untrained_note`, which every command
    calls then), so that a usage error found before stays the only line."""
    click.get_current_context().meta.setdefault(_LATER, []).append(message)


def untrained_note(model_spec, weights) -> bool:
    """Once the inputs are checked: print the warnings kept for then (`warn_later`), and warn that
    a --model without --weights keeps the factory's own weights, random unless it loads some;
    returns whether it does (`emit(untrained=)` says so in the title and the JSON)."""
    for message in click.get_current_context().meta.pop(_LATER, []):
        warn(message)
    if model_spec is None or weights is not None:
        return False
    warn(
        f"--model {model_spec} without --weights: using the factory's weights as they are "
        "(randomly initialised unless it loads trained ones)"
    )
    return True


def resolve_test_data(
    test_file: str | None, data: str, test_samples: int | None, model=None, x_train=None
):
    """Test inputs and labels: a --test file, or the digits test split when training on digits;
    checked against the model like --data."""
    if test_file is not None:
        x_test, y_test = load_arrays(test_file, "test")
    elif data == "digits":
        from ntk import demo

        split = demo.digits()
        x_test, y_test = split.x_test, split.y_test
    else:
        raise UsageProblem("--test is needed with a training data file")
    from ntk.core import inputs

    total = inputs.count(x_test)
    source = click.get_current_context().get_parameter_source("test_samples")
    chosen = source not in (None, click.core.ParameterSource.DEFAULT)  # given: nothing to say
    if test_file is not None and test_samples is not None and total > test_samples and not chosen:
        warn_later(
            f"using the first {test_samples} of the {total} samples of --test "
            "(--test-samples N to change)"
        )
    more_than_held("test_samples", total, "test")
    x_test = inputs.take(x_test, slice(0, test_samples))
    y_test = None if y_test is None else y_test[:test_samples]
    if model is not None:
        x_test = in_model_dtype(model, x_test, "test")
        check_fits(model, x_test, "test")
    if x_train is not None:  # before any work: inputs structured unlike --data's (the model
        try:  # took x_test above, so other per-sample shapes, such as longer sequences, are fine)
            inputs.check_structure(x_train, x_test, ("--data", "--test"))
        except ValueError as exc:
            raise UsageProblem(str(exc)) from None
    return x_test, y_test


def check_fits(model: nn.Module, x, option: str = "data") -> None:
    """Run one sample through the model: data the model cannot take is a usage error naming
    --option (exit 2); a forward pass that fails once a layer with trainable parameters has
    taken the data (`ModelForwardError`: inner layers of mismatched sizes, any exception of the
    model's own code) is a fault of the
    model, reported with the data's shape but without blaming the data (`ModelFailure`, exit 1)."""
    import torch

    from ntk.core import inputs
    from ntk.core.model import ModelForwardError, ModelInputError, describe_inputs, naming_failures

    got = (
        f"shape {tuple(x.shape[1:])} ({x.dtype})"
        if isinstance(x, torch.Tensor)
        else describe_inputs(x)
    )
    one = inputs.take(x, slice(0, 1))
    first = next(model.parameters(), None)
    one = one if first is None else inputs.convert(one, first.device, None)
    args, kwargs = inputs.as_call(one)
    try:
        with torch.no_grad():
            naming_failures(model, one, f"--{option}", lambda: model(*args, **kwargs))
    except ModelForwardError as exc:
        raise ModelFailure(
            f"the model's forward pass failed in module {exc.module} on one --{option} sample "
            f"of {got}: {_first_line(exc.__cause__)}"
        ) from None
    except ModelInputError as exc:
        if exc.__cause__ is None:  # a message of its own (embedding ids out of range)
            raise UsageProblem(str(exc)) from None
        raise UsageProblem(
            f"--{option}: the model cannot take samples of {got}: {_first_line(exc.__cause__)}"
        ) from None
