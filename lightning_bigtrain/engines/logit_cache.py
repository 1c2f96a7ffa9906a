"""LogitCache: the teacher's top-k logits per input sample, a stateful store the distillation callback reads
and writes (the losses it feeds are in :mod:`lightning_bigtrain.functional.distillation`)."""

from __future__ import annotations

import torch

__all__ = ["LogitCache"]


class LogitCache:
    """Teacher top-k logits (values in fp16, class indices) per input sample, addressed by the sample's content.

    Content addressing makes the cache valid across epochs, shuffles and runs on the same data, and makes
    inputs it has not seen (new data, random augmentation) misses rather than wrong answers. The file
    records the teacher's fingerprint; :meth:`load` refuses a file written for another teacher.

    Args:
        teacher_fingerprint: :func:`module_fingerprint` of the teacher.
        k: Logits kept per position.
        temperature: The temperature of the stored log-partitions.
    """

    FORMAT = 1

    def __init__(self, teacher_fingerprint: str, k: int, temperature: float) -> None:
        if k < 1:
            raise ValueError(f"LogitCache: `k={k}` must be >= 1.")
        self.teacher = teacher_fingerprint
        self.k = k
        self.temperature = float(temperature)
        self._index: dict[bytes, int] = {}
        self._rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._stacked: list[torch.Tensor] | None = None  # the rows as three tensors, rebuilt after a put
        self.new: list[tuple[bytes, torch.Tensor, torch.Tensor, torch.Tensor]] = []  # added since take_new()

    def __len__(self) -> int:
        return len(self._index)

    def get(self, keys: list[bytes]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Stacked (values, indices, log_partition) for every key, or None if any key is missing."""
        found = [self._index.get(k) for k in keys]
        if any(r is None for r in found):
            return None
        if self._stacked is None:
            self._stacked = [torch.stack(parts) for parts in zip(*self._rows, strict=True)]
        rows = torch.tensor(found)
        values, indices, log_partition = (t.index_select(0, rows) for t in self._stacked)
        return values, indices, log_partition

    def put(
        self,
        keys: list[bytes],
        values: torch.Tensor,
        indices: torch.Tensor,
        log_partition: torch.Tensor,
        *,
        record: bool = True,
    ) -> None:
        """Add the top-k of each sample (first dimension of the three tensors) under its key."""
        values = values.detach().to("cpu", torch.float16)
        indices = indices.detach().to("cpu", torch.int32)
        log_partition = log_partition.detach().to("cpu", torch.float32)
        for i, key in enumerate(keys):
            if key in self._index:
                continue
            self._index[key] = len(self._rows)
            row = (values[i].clone(), indices[i].clone(), log_partition[i].clone())
            self._rows.append(row)
            self._stacked = None
            if record:
                self.new.append((key, *row))

    def take_new(self) -> list[tuple[bytes, torch.Tensor, torch.Tensor, torch.Tensor]]:
        new, self.new = self.new, []
        return new

    def save(self, url: str) -> None:
        """Write every entry to ``url`` (a local path or an fsspec URL such as ``s3://bucket/kd.pt``)."""
        import fsspec

        keys = list(self._index)
        if not keys:
            raise ValueError("LogitCache.save: the cache is empty.")
        columns = [torch.stack(parts) for parts in zip(*self._rows, strict=True)]
        payload = {
            "format": self.FORMAT,
            "teacher": self.teacher,
            "k": self.k,
            "temperature": self.temperature,
            "keys": torch.frombuffer(bytearray(b"".join(keys)), dtype=torch.uint8).reshape(len(keys), 16),
            "values": columns[0],
            "indices": columns[1],
            "log_partition": columns[2],
        }
        fs, path = fsspec.core.url_to_fs(url)
        parent = path.rsplit("/", 1)[0] if "/" in path else ""
        if parent:
            fs.makedirs(parent, exist_ok=True)
        with fs.open(path, "wb") as f:
            torch.save(payload, f)

    @classmethod
    def load(cls, url: str, teacher_fingerprint: str, k: int, temperature: float) -> LogitCache | None:
        """The cache stored at ``url``; None if there is none. Raises if it was written for another teacher,
        ``k`` or temperature."""
        import fsspec

        fs, path = fsspec.core.url_to_fs(url)
        if not fs.exists(path):
            return None
        with fs.open(path, "rb") as f:
            payload = torch.load(f, map_location="cpu", weights_only=True)
        if payload.get("format") != cls.FORMAT:
            raise ValueError(f"`cache={url!r}` is not a logit cache of lightning_bigtrain: {payload.get('format')=}")
        saved = (payload["teacher"], payload["k"], payload["temperature"])
        if saved != (teacher_fingerprint, k, float(temperature)):
            raise ValueError(
                f"`KnowledgeDistillation(cache={url!r})` was written for another teacher, top-k or temperature "
                f"(teacher {saved[0]}, k={saved[1]}, T={saved[2]}; this run: teacher {teacher_fingerprint}, k={k}, "
                f"T={float(temperature)}). Point cache= at another location, delete the file, or pass "
                "DistillationOptions(rebuild_cache=True) to overwrite it."
            )
        cache = cls(teacher_fingerprint, k, temperature)
        keys = [bytes(row.tolist()) for row in payload["keys"]]
        cache.put(keys, payload["values"], payload["indices"], payload["log_partition"], record=False)
        return cache
