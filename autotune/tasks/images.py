"""A class per image (`model.task: image-classification`): ViT and its kin under Trainer.
Its sequence is its image's patches, sized from its config (a sample's tokens are its
patches); its rows are images sized from the config (synthetic), or an image folder or
dataset read through the model's image processor."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from autotune.errors import SetupError
from autotune.tasks.base import Task

if TYPE_CHECKING:
    from autotune.spec import Spec

# Distinct synthetic images a trial cycles through: their values change neither the step's
# time nor its memory, and a pool keeps the host's share small (a ViT-base image is
# 600 KB) without generating pixels inside the timed steps.
IMAGE_POOL = 32


class ImageClassification(Task):
    name = "image-classification"
    auto_class = "AutoModelForImageClassification"
    # PEFT has no task type for it: the adapters wrap the model as it is, and its
    # classifier head, new for the task, trains whole.
    lora_task_type = None
    lora_trained_modules = ("classifier",)
    replayable = False  # its input is pixels, not the token ids the replay follows
    reads_images = True
    units = ("images", "patches", "an image's tokens are its patches")
    model_types = ("vit",)
    data_comment = ("synthetic images sized from the model's config as written (no "
                    "seq_len: the sequence is its patches);\nfor your images set source (a "
                    "folder with a subfolder per class, or a dataset with image and label)"
                    "\nand processor (the image processor's folder), unless "
                    "model.name_or_path holds one.")

    def lengths(self, spec: Spec) -> dict[str, int]:
        return {}  # its sequence is its patches, from its config

    def check(self, spec: Spec) -> str | None:
        data = spec.data
        if data.target_len is not None:
            return (f"data.target_len: {data.target_len}: only a seq2seq-lm model has a "
                    f"target; this model's task is {self.name}")
        if data.format not in ("auto", "image"):
            return (f"data.format: {data.format!r}: an image-classification model reads "
                    "images (format image: an image folder or a dataset with image and "
                    "label columns)")
        if (data.source != "synthetic" and data.processor is None
                and spec.model.name_or_path is None):
            return ("data.processor: images are read through the model's image processor: "
                    "give data.processor (a folder with its preprocessor_config.json) or "
                    "model.name_or_path")
        return None

    def notes(self, spec: Spec) -> list[str]:
        if "seq_len" not in spec.data.model_fields_set:
            return []
        return ["data.seq_len is not read for image-classification: the model's sequence "
                "is its image's patches, sized from its config"]

    def trace_inputs(self, hf_config: Any, seq_len: int, batch: int, target_len: int,
                     rows: int) -> dict[str, Any]:
        import torch

        size = hf_config.image_size
        h, w = (size, size) if isinstance(size, int) else tuple(size)[:2]
        channels = image_pixels(hf_config) // (h * w)
        return {"pixel_values": torch.randn(batch, channels, h, w),
                "labels": torch.zeros(batch, dtype=torch.long)}

    def rows(self, spec: Spec, model: Any, n_samples: int,
             seed: int) -> tuple[Any, dict[str, float] | None]:
        return image_dataset(spec, model, n_samples, seed), None

    def counter(self, shape: dict[str, Any] | None) -> Callable[[dict], tuple] | None:
        patches = int((shape or {}).get("seq_len") or 1)
        return lambda x: (x["pixel_values"].shape[0], x["pixel_values"].shape[0] * patches)

    def objective(self, spec: Spec) -> str:
        """Images/s: its tokens are patches, as many in every image."""
        from autotune.records import SAMPLES_PER_SECOND

        return SAMPLES_PER_SECOND


IMAGE_CLASSIFICATION = ImageClassification()


def image_pixels(cfg: Any) -> int:
    """Input values per image (channels x height x width), from the config."""
    size = getattr(cfg, "image_size", None)
    h, w = (size, size) if isinstance(size, int) else tuple(size or (0, 0))[:2]
    return int(getattr(cfg, "num_channels", 3) or 3) * int(h) * int(w)


def image_tokens(model: Any) -> int | None:
    """The sequence an image model's encoder runs on: its position embeddings' length
    (patches and class token), or (image/patch)^2 + 1; None for no image model."""
    cfg = getattr(model, "config", None)
    for name, p in model.named_parameters():
        if name.endswith("position_embeddings") and p.dim() == 3:
            return int(p.shape[1])
    size, patch = getattr(cfg, "image_size", None), getattr(cfg, "patch_size", None)
    if isinstance(size, int) and isinstance(patch, int) and patch:
        return (size // patch) ** 2 + 1
    return None


class ImageRows:
    """Rows of pixel values and a label, drawn from a pool of `len(pool)` (synthetic: their
    values change neither speed nor memory), or one per real image."""

    def __init__(self, pool: list[dict], n: int) -> None:
        self.pool, self.n = pool, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return self.pool[i % len(self.pool)]


def image_dataset(spec: Spec, model, n_samples: int, seed: int = 0) -> ImageRows:
    """`n_samples` images of the model's size with a label each: random pixels, or the
    source's images through the model's image processor."""
    import torch

    cfg = model.config
    classes = int(getattr(cfg, "num_labels", 2) or 2)
    data = spec.data.model_dump()
    if data["source"] != "synthetic":
        return ImageRows(_real_images(data, spec.model.name_or_path, n_samples, classes),
                         n_samples)
    channels = int(getattr(cfg, "num_channels", 3) or 3)
    side = image_pixels(cfg) // channels
    size = getattr(cfg, "image_size", None)
    h, w = (size, size) if isinstance(size, int) else tuple(size)[:2]
    if h * w != side:
        raise SetupError("model.config", "an image model's config needs image_size (and "
                         "num_channels) to size its synthetic images")
    g = torch.Generator().manual_seed(seed)
    pool = [{"pixel_values": torch.randn(channels, h, w, generator=g),
             "labels": torch.randint(0, classes, (), generator=g)}
            for _ in range(min(n_samples, IMAGE_POOL))]
    return ImageRows(pool, n_samples)


def _real_images(data: dict[str, Any], model_path: str | None, n: int,
                 classes: int) -> list[dict]:
    """Each image through the image processor (data.processor, or the model folder's),
    with its label; a label the model's head has no class for is named."""
    import torch
    from transformers import AutoImageProcessor

    from autotune.tasks.data import data_format, read_rows

    rows = read_rows(data["source"], n)
    data_format(data | {"format": "image"}, list(rows.column_names))
    where = data.get("processor") or model_path
    try:
        processor = AutoImageProcessor.from_pretrained(where)
    except Exception as exc:  # noqa: BLE001 - a folder without one raises anything
        field = "data.processor" if data.get("processor") else "model.name_or_path"
        raise SetupError(field, f"{where!r} has no image processor: {type(exc).__name__}: "
                         f"{str(exc).splitlines()[0][:200]}") from exc
    out = []
    for i, row in enumerate(rows):
        label = row.get("label")
        if not isinstance(label, int) or not 0 <= label < classes:
            raise SetupError("data.source", f"row {i}: label {label!r} is no class of the "
                             f"model's {classes} (set num_labels in its config)")
        pixels = processor(images=[row["image"].convert("RGB")],
                           return_tensors="pt")["pixel_values"][0]
        out.append({"pixel_values": pixels, "labels": torch.tensor(label)})
    return (out * (n // len(out) + 1))[:n]
