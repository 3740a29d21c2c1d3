"""What one server will take: `ServerLimits`, each limit with its default, checked in one place. Chapter 05
(appendix).

Every limit refuses with a clear status naming it (and the flag that sets it), and the server keeps serving:
- `max_body_bytes`: a request body beyond it is 413, before it is parsed (8 MiB: a prompt at
  max_model_len of most models is far less);
- `max_n`: completions per request (`n`), 400;
- `max_prompt_tokens`: prompt tokens per prompt, 400 (None: max_model_len alone, which the engine checks);
- `max_queued_seqs`: sequences waiting to start (a request of n completions counts n); a request that would
  go beyond it is 503 with Retry-After, queuing nothing;
- `first_token_timeout_s`: the longest a request may wait for its first token; then it is aborted, its KV
  blocks freed, and the client gets 503 with Retry-After (a stream: an error chunk) saying so;
- `max_unread_chunks`: stream chunks a client may leave unread (it stopped reading; TCP's buffers are full);
  beyond them its request is aborted instead of generating on into memory.
None turns a limit off.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from nanoengine.errors import InvalidValueError


@dataclass(frozen=True)
class ServerLimits:
    max_body_bytes: int | None = 8 * 2**20
    max_n: int | None = 64
    max_prompt_tokens: int | None = None
    max_queued_seqs: int | None = 4096
    first_token_timeout_s: float | None = 300.0
    max_unread_chunks: int | None = 1024

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            seconds = f.name.endswith("_s")
            ok = isinstance(value, (int, float) if seconds else int) and not isinstance(value, bool)
            if not ok or not value > 0:
                what = "a number of seconds" if seconds else "an integer"
                raise InvalidValueError(f"ServerLimits: {f.name} ({self.flag(f.name)}) must be {what} > 0, "
                                        f"or None for no limit; got {value!r}")

    @staticmethod
    def flag(name: str) -> str:
        """The `nanoengine serve` flag that sets a limit (for messages)."""
        return "--" + name.removesuffix("_s").replace("_", "-")

    def as_flags(self) -> list[str]:
        """The `nanoengine serve` command line that sets these limits (0: no limit)."""
        return [arg for f in dataclasses.fields(self)
                for arg in (self.flag(f.name), str(getattr(self, f.name) or 0))]
