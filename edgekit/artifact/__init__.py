"""Artifact folders, their manifest, atomic outputs and locks.

Every step (compress, export, build, profile, run) writes one folder holding its files and a
``manifest.json`` (``manifest.py``), staged and swapped into place atomically so that nothing
half-written is ever left and nothing edgekit did not write is replaced (``atomic.py``);
processes that share a folder or a cache entry take a lock (``locks.py``); ``files.py`` holds
the filesystem helpers they share. The names below are the ones the rest of edgekit uses.
"""
from edgekit.artifact.atomic import (
    apply_umask,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    check_output_dir,
    check_output_file,
    check_work_folder,
    claim_work_folder,
    copy_tree,
    not_replaceable,
    own_hidden_entry,
    recover_abandoned_outputs,
    staged_dir,
    umask,
    work_folder,
    write_manifest,
)
from edgekit.artifact.files import cache_dir
from edgekit.artifact.locks import LOCK_FILE, file_lock, folder_lock, lock_holder
from edgekit.artifact.manifest import (
    KINDS,
    MANIFEST,
    SCHEMA_VERSION,
    Manifest,
    input_record,
    is_artifact,
    machine_info,
    now_iso,
    package_versions,
    read_manifest,
    sha256_file,
    sha256_json,
    sha256_tree,
)

__all__ = [
    "cache_dir",
    "MANIFEST",
    "SCHEMA_VERSION",
    "KINDS",
    "Manifest",
    "now_iso",
    "package_versions",
    "machine_info",
    "sha256_file",
    "sha256_tree",
    "sha256_json",
    "is_artifact",
    "read_manifest",
    "input_record",
    "LOCK_FILE",
    "lock_holder",
    "folder_lock",
    "file_lock",
    "atomic_write_bytes",
    "atomic_write_text",
    "atomic_write_json",
    "staged_dir",
    "recover_abandoned_outputs",
    "umask",
    "apply_umask",
    "copy_tree",
    "check_output_dir",
    "own_hidden_entry",
    "not_replaceable",
    "check_output_file",
    "work_folder",
    "claim_work_folder",
    "check_work_folder",
    "write_manifest",
]
