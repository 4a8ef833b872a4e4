"""What adapter and model sources share: the parsed `Source`, the errors, and the `FileSet` a load takes.

A `FileSet` says which files a load takes (ADAPTER_FILESET, MODEL_FILESET): only safetensors weights, never
pickle; a source with only pickle weights is refused. Errors never carry a credential (scrub_secrets).
"""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass
from pathlib import Path

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILE = "adapter_model.bin"
README_FILE = "README.md"
REQUIRED_FILES = (CONFIG_FILE, WEIGHTS_FILE)
ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE, README_FILE)


class SourceError(Exception):
    """A source that cannot be used; the message says what to fix.

    str(error) is for admins and logs (it may name URLs and paths, never credentials); `public` says the same
    without them, for clients that may not see the server's sources.
    """

    def __init__(self, message: str, public: str | None = None, transient: bool = False) -> None:
        super().__init__(message)
        self.public = public or "the source could not be used; an admin can see why in the server's log"
        # True when trying again later may succeed (a connection failure, a timeout, a 5xx or 429 from the
        # store); False when only a change of the source or of the server's settings can (missing, refused,
        # malformed): the operator retries the first kind with backoff and fails the second at once
        self.transient = transient


class AdapterSourceError(SourceError):
    """An adapter source that cannot be used."""

    def __init__(self, message: str, public: str | None = None, transient: bool = False) -> None:
        super().__init__(
            message,
            public or "the adapter source could not be used; an admin can see why in the adapter list",
            transient,
        )


class ModelSourceError(SourceError):
    """A base model source that cannot be used (the server does not start; the message is its reason)."""


def transient_status(status: int) -> bool:
    return status >= 500 or status in (408, 429)


_SECRET_ENV = ("HF_TOKEN", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "LORAPLANE_ADMIN_TOKEN")


def scrub_secrets(text: str) -> str:
    """text with the values of the credential variables masked: an error from a library we do not control
    (a start-up failure's reason or traceback) must not carry one to /ready, a log or a pod's status."""
    for name in _SECRET_ENV:
        value = os.environ.get(name, "")
        if len(value) >= 4:
            text = text.replace(value, f"<{name}>")
    return text


@dataclass(frozen=True)
class Source:
    """A parsed, validated URI; `uri` is its canonical form (for allowlists and cache keys)."""

    kind: str  # "local" | "hf" | "s3" | "http"
    uri: str
    path: Path | None = None  # local: absolute, symlinks kept
    repo_id: str | None = None  # hf: org/repo
    revision: str | None = None  # hf: None for the default branch
    subfolder: str = ""  # hf
    bucket: str | None = None  # s3
    prefix: str = ""  # s3: no leading or trailing "/"
    url: str | None = None  # http and https


AdapterSource = Source  # the name the adapter code has always used


# which files a load takes


@dataclass(frozen=True)
class FileSet:
    """The files of a source that a load takes (top level only); nothing else is ever fetched."""

    what: str  # "adapter" | "model"
    names: tuple[str, ...]  # taken by exact name
    patterns: tuple[str, ...]  # taken by glob (model shards)
    ignored: tuple[str, ...]  # globs never taken though a pattern matches (Mistral's consolidated.safetensors)
    required: str  # the config file without which the source is not one
    weights_glob: str  # at least one file must match
    pickle_patterns: tuple[str, ...]  # pickle weights: never taken; a source with only these is refused
    pickle_hint: str

    def wants(self, name: str) -> bool:
        if any(fnmatch.fnmatchcase(name, p) for p in self.ignored):
            return False
        return name in self.names or any(fnmatch.fnmatchcase(name, p) for p in self.patterns)

    def allow_patterns(self, subfolder: str = "") -> list[str]:
        """huggingface_hub's allow_patterns for these files."""
        sub = f"{subfolder}/" if subfolder else ""
        return [sub + n for n in (*self.names, *self.patterns)]

    def ignore_patterns(self, subfolder: str = "") -> list[str]:
        """huggingface_hub's ignore_patterns: its fnmatch lets "*" match "/" too, so nested files go here."""
        sub = f"{subfolder}/" if subfolder else ""
        return [f"{sub}*/*", *(sub + n for n in self.ignored)]

    def error(self, message: str) -> SourceError:
        return AdapterSourceError(message) if self.what == "adapter" else ModelSourceError(message)

    def check(self, names: set[str], where: str) -> None:
        """Refuse (with what to fix) a set of top-level file names that a load cannot use."""
        if self.required not in names:
            raise self.error(f"{where} has no {self.required} (expected {self.expected()})")
        if any(fnmatch.fnmatchcase(n, self.weights_glob) and self.wants(n) for n in names):
            return
        pickled = sorted(n for n in names if any(fnmatch.fnmatchcase(n, p) for p in self.pickle_patterns))
        if pickled:
            shown = ", ".join(pickled[:4])
            raise self.error(f"{where} has only pickle weights ({shown}), which are never loaded; {self.pickle_hint}")
        raise self.error(f"{where} has no {self.weights_glob}")

    def expected(self) -> str:
        return "a PEFT LoRA adapter" if self.what == "adapter" else f"{self.required} and *.safetensors"


ADAPTER_FILESET = FileSet(
    what="adapter",
    names=ADAPTER_FILES,
    patterns=(),
    ignored=(),
    required=CONFIG_FILE,
    weights_glob=WEIGHTS_FILE,
    pickle_patterns=(PICKLE_FILE,),
    pickle_hint=f"save the adapter as {WEIGHTS_FILE} instead (PeftModel.save_pretrained(..., safe_serialization=True))",
)
MODEL_FILESET = FileSet(
    what="model",
    names=(
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "tokenizer.model",
        "vocab.json",
        "merges.txt",
        "added_tokens.json",
        "chat_template.jinja",
        "chat_template.json",
        "model.safetensors.index.json",
    ),
    patterns=("*.safetensors",),
    ignored=("consolidated*.safetensors",),  # the same weights again in Mistral's own format
    required="config.json",
    weights_glob="*.safetensors",
    pickle_patterns=("*.bin", "*.pt", "*.pth"),
    pickle_hint="convert the weights to safetensors (model.save_pretrained(..., safe_serialization=True))",
)
