"""Base class of the moejax TFDS builders: offline generator builders, no tensorflow needed.

The builders write ``array_record`` files (the only TFDS format readable without tensorflow,
through ``builder.as_data_source()`` / ``tfds.data_source``). They download nothing, so they
have no checksums file; ``code_path`` is ``None`` to keep TFDS from probing the package with
``importlib_resources`` (absent from this environment, and only used to find checksums and
metadata files next to the builder's code). Nor do they have pre-computed metadata on TFDS's
bucket, so their ``DatasetInfo`` skips that lookup (which makes a temporary folder before it
finds nothing, and leaves it behind, every time a builder of an unbuilt dataset is made).
"""

from __future__ import annotations

from moejax.extras import missing_extra

try:
    import tensorflow_datasets as tfds
except ImportError as _e:
    raise missing_extra(_e, "moejax.data.tfds_base (the TFDS datasets)") from None

__all__ = ["OfflineBuilder"]


class _OfflineInfo(tfds.core.DatasetInfo):
    """The ``DatasetInfo`` of an offline builder: nothing to look up on TFDS's bucket."""

    def initialize_from_bucket(self) -> None:  # noqa: D102
        return None


class OfflineBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """A GeneratorBasedBuilder that reads only local files."""

    @tfds.core.utils.classproperty
    @classmethod
    def code_path(cls):  # noqa: D102
        return None

    def dataset_info_from_configs(self, **kwargs) -> tfds.core.DatasetInfo:
        """The dataset's info from ``kwargs`` (an offline builder has no metadata files)."""
        return _OfflineInfo(builder=self, **kwargs)
