"""Lets PySpark find the "qserver" data source by itself: no
`spark.dataSource.register(...)` needed.

PySpark (4.0 and later, `pyspark/sql/worker/lookup_data_sources.py`) looks
for Python data sources once per session, the first time a query names a
format it does not know: it imports every top-level module on its workers'
Python path whose name starts with `pyspark_` and registers the
`DefaultSource` it finds there under `DefaultSource.name()`. This module is
that: installed next to `qserver_spark`, it makes `format("qserver")` work
for reads and writes.

The lookup lists modules with `pkgutil.iter_modules()`, which sees the
directories on `sys.path`: a regular install (`pip install '.[spark]'`), an
editable install in compat mode (`pip install -e . --config-settings
editable_mode=compat`) or `PYTHONPATH=spark_integration`. It does not see a
package that setuptools' default editable install maps in with an import
hook; there, call `spark.dataSource.register(qserver_spark.QServerDataSource)`.
"""

from qserver_spark import QServerDataSource as DefaultSource

__all__ = ["DefaultSource"]
