"""A node's storage on disk: the log in checksummed segment files, snapshots
of the state machine, the persisted vote (design.md section 3).

`format` holds the byte formats and does no I/O; `disk` does the I/O;
`recovery` reads a directory back for `DiskStorage.recover()`;
`kernel_sync` hands fdatasync to the kernel (Linux AIO) for the adapter.
"""

from .disk import (
    SEGMENT_BYTES,
    DiskStorage,
    Recovered,
    StorageError,
    private_tmp_dir,
    remove_private_tmp_dir,
    snapshot_file_name,
    unlink_quietly,
    write_snapshot_file,
)
from .format import (
    FRAME_HEADER_BYTES,
    decode_snapshot,
    encode_payload,
    encode_record,
    record_size_bound,
    store_wire_iter,
)
from .kernel_sync import KernelSync

__all__ = ["DiskStorage", "KernelSync", "Recovered", "StorageError", "SEGMENT_BYTES",
           "store_wire_iter", "decode_snapshot", "encode_payload", "encode_record",
           "FRAME_HEADER_BYTES", "record_size_bound",
           "snapshot_file_name", "unlink_quietly", "write_snapshot_file", "private_tmp_dir",
           "remove_private_tmp_dir"]
