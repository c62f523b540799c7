"""A remote store of PEFT adapters over HTTP(S) (`--adapter-source URL`), as LoRAX's adapter sources: an
adapter that a request names and the server has nowhere else is fetched from `URL/<name>/` (or from the
URL with `{name}` in it: `https://huggingface.co/my-org/{name}/resolve/main`) into a local cache folder,
then registered from there like any other. Only `adapter_config.json` and `adapter_model.safetensors`
are fetched (never pickled `.bin` files).

Invariants:
- A cache folder `<cache>/<name>` exists only complete: both files are written into a folder of their own
  and renamed into place once the safetensors file's header and length agree (a cut download never
  lands). A folder the engine then refuses (bad config, shapes) is removed, so a fixed store is fetched
  again.
- A name the store does not have (or a fetch that failed) is remembered for `retry_after_s` with the
  reason: requests for it in that time get the 404 at once, without asking the store again.
- Bytes are bounded: a config over 1 MB or weights over `max_bytes` are refused while being read.
`LORAPLEX_ADAPTER_SOURCE_TOKEN`, when set, is sent as `Authorization: Bearer` (a private Hub or store).
`hf://ORG` (or `hf://ORG@REVISION`) is the Hugging Face Hub's `ORG/<name>` repositories: `$HF_ENDPOINT/ORG/
{name}/resolve/main` (`HF_TOKEN` as the token, unless the one above is set).
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import struct
import time
import uuid
from pathlib import Path
from urllib.parse import quote

from ipc.adapter_names import check_adapter_name

FILES = ("adapter_config.json", "adapter_model.safetensors")
MAX_CONFIG_BYTES = 1 << 20
CHUNK = 1 << 20


class FetchRefused(LookupError):
    """The store does not have the adapter, or it could not be fetched: the reason, for the client's 404."""


def hub_url(source: str, endpoint: str) -> str:
    """`hf://ORG[@REVISION]` as the URL of its repositories' files."""
    org, _, revision = source.removeprefix("hf://").strip("/").partition("@")
    if not org or "/" in org:
        raise ValueError(f"--adapter-source: {source!r}: give the Hub's organization or user, hf://ORG")
    return f"{endpoint}/{quote(org)}/{{name}}/resolve/{quote(revision or 'main', safe='')}"


class AdapterSource:
    def __init__(self, url: str, cache_dir: str | Path, token: str | None = None, max_bytes: int = 4 << 30,
                 timeout_s: float = 300.0, retry_after_s: float = 60.0, concurrency: int = 4):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--adapter-source: {url!r} is not an http:// or https:// URL")
        self.url, self.cache = url, Path(cache_dir)
        self.token, self.max_bytes, self.timeout_s, self.retry_after_s = token, max_bytes, timeout_s, retry_after_s
        self.refused: dict[str, tuple[float, str]] = {}        # name -> (until when, why)
        self.limit = asyncio.Semaphore(concurrency)             # fetches at once
        self._session = None

    def file_url(self, name: str, file: str) -> str:
        check_adapter_name(name)
        base = self.url.replace("{name}", quote(name)) if "{name}" in self.url else \
            f"{self.url.rstrip('/')}/{quote(name)}"
        return f"{base.rstrip('/')}/{file}"

    def cached(self, name: str) -> Path | None:
        """The adapter's complete cache folder, if it was fetched."""
        path = self.cache / name
        return path if all((path / f).is_file() for f in FILES) else None

    def refusal(self, name: str) -> str | None:
        """Why `name` was refused, while that is remembered."""
        entry = self.refused.get(name)
        if entry is None:
            return None
        if time.monotonic() >= entry[0]:
            del self.refused[name]
            return None
        return entry[1]

    def refuse(self, name: str, why: str) -> None:
        self.refused[name] = (time.monotonic() + self.retry_after_s, why)

    def drop(self, name: str) -> None:
        """Remove a cached adapter (the engine refused its files)."""
        shutil.rmtree(self.cache / name, ignore_errors=True)

    async def fetch(self, name: str) -> Path:
        """Fetch `name` into the cache -> its folder; FetchRefused with the reason (also remembered)."""
        try:
            async with self.limit:
                return await asyncio.wait_for(self._fetch(name), self.timeout_s)
        except FetchRefused as e:
            self.refuse(name, str(e))
            raise
        except asyncio.TimeoutError:
            why = f"fetching adapter {name!r} from {self.file_url(name, '')} took longer than {self.timeout_s:.0f} s"
        except Exception as e:  # noqa: BLE001 - the network, the disk: this adapter's requests get the reason
            why = f"fetching adapter {name!r} from {self.file_url(name, '')} failed: {type(e).__name__}: {e}"
        self.refuse(name, why)
        raise FetchRefused(why)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def _fetch(self, name: str) -> Path:
        done = self.cached(name)
        if done is not None:
            return done
        self.cache.mkdir(parents=True, exist_ok=True)
        part = self.cache / f".partial-{name}-{uuid.uuid4().hex[:8]}"
        part.mkdir()
        try:
            config = await self._get(name, FILES[0], part, MAX_CONFIG_BYTES)
            try:
                if not isinstance(json.loads(config.read_bytes()), dict):
                    raise ValueError("not a JSON object")
            except ValueError as e:
                raise FetchRefused(f"adapter {name!r}: {self.file_url(name, FILES[0])} is not an adapter config "
                                   f"({e})") from None
            check_safetensors(await self._get(name, FILES[1], part, self.max_bytes), self.file_url(name, FILES[1]))
            try:
                os.replace(part, self.cache / name)
            except OSError:          # another process of this cache got there first: theirs is complete too
                if self.cached(name) is None:
                    raise
            return self.cache / name
        finally:
            shutil.rmtree(part, ignore_errors=True)

    async def _get(self, name: str, file: str, folder: Path, limit: int) -> Path:
        url = self.file_url(name, file)
        async with self._client().get(url) as resp:
            if resp.status != 200:
                raise FetchRefused(f"adapter {name!r} is not available: {url} answered HTTP {resp.status}")
            if resp.content_length is not None and resp.content_length > limit:
                raise FetchRefused(f"adapter {name!r}: {url} is {resp.content_length} bytes, over the limit of "
                                   f"{limit} bytes")
            path, size = folder / file, 0
            with open(path, "wb") as out:
                async for chunk in resp.content.iter_chunked(CHUNK):
                    size += len(chunk)
                    if size > limit:
                        raise FetchRefused(f"adapter {name!r}: {url} is over the limit of {limit} bytes")
                    out.write(chunk)
        return path

    def _client(self):
        if self._session is None:
            import aiohttp
            headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
            self._session = aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=10, sock_read=60))
        return self._session


def check_safetensors(path: Path, url: str) -> None:
    """FetchRefused unless `path` is a whole safetensors file: its header parses and its tensors' data ends
    where the file does (a cut download does not)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        try:
            if not 2 <= n <= min(size - 8, 100 << 20):
                raise ValueError(f"a header length of {n}")
            header = json.loads(f.read(n))
            end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError) as e:
            raise FetchRefused(f"{url} is not a safetensors file ({e})") from None
    if 8 + n + end != size:
        raise FetchRefused(f"{url} is cut short or padded: {size} bytes, its header describes {8 + n + end}")
