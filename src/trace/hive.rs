//! Hive-style `key=value/` folders of a data file, as column values.
//!
//! The contract allows Hive folders under `requests/` and `kv/`
//! (`kv/pool=1/part-00003.parquet`). Writers that partition by a column
//! (pyarrow `write_dataset(partitioning=..., flavor="hive")`, DuckDB
//! `COPY ... PARTITION_BY`, Spark `partitionBy`) keep that column in the
//! folder name only and drop it from the file, and every Parquet reader
//! (DuckDB, Spark, pandas, Polars) puts it back from the path. So do we:
//! a contract column absent from a file takes the value of a folder of the
//! same name. When the file has the column too, the folder must agree with
//! every row: a file under `kv/pool=1/` holding pool 0 events contradicts
//! itself, and which of the two is wrong cannot be known, so it is an error
//! naming the file, the row and the column rather than a silent choice.
//! Folders whose key is not a column of the table (`date=...`) are ignored.
//! Two folders of one key on one path (`kv/pool=0/pool=1/`) contradict each
//! other in the same way unless they say the same value: an error naming
//! both. A folder value the column's type cannot hold (`pool=%ZZ`) is an
//! error naming the folder and the value, not the column's type.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use arrow_array::cast::AsArray;
use arrow_array::types::Int64Type;
use arrow_array::{Array, ArrayRef, Int64Array, RecordBatch, StringArray, UInt64Array};
use arrow_schema::{DataType, Field, Schema};

use crate::error::{Error, Location, Result};

/// Hive's spelling of a null partition value.
const HIVE_NULL: &str = "__HIVE_DEFAULT_PARTITION__";

/// One `key=value` folder above a data file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct HivePair {
    pub key: String,
    /// The decoded value; `None` is Hive's null.
    pub value: Option<String>,
    /// The folder's name as it is on disk (`pool=%ZZ`).
    pub folder: String,
}

/// The `key=value` folders between the table root (`kv/` or `requests/`)
/// and the file, outermost first, one per key.
pub(crate) type HivePairs = Vec<HivePair>;

/// Field metadata of a column filled in from a folder: the folder's name.
pub(crate) const FOLDER_META: &str = "kvtrail.hive_folder";
/// Field metadata of a column filled in from a folder: its decoded value
/// (absent for Hive's null).
pub(crate) const VALUE_META: &str = "kvtrail.hive_value";

/// Hive pairs of `path`: folder names of the form `key=value` below the
/// nearest ancestor named `kv` or `requests`, keeping only keys in `names`.
/// Two folders of one key that say different values are an error naming
/// both.
pub(crate) fn pairs(path: &Path, names: &[&str]) -> Result<HivePairs> {
    let mut out: HivePairs = Vec::new();
    let mut dir = path.parent();
    while let Some(d) = dir {
        let Some(name) = d.file_name().and_then(|n| n.to_str()) else {
            break;
        };
        if name == "kv" || name == "requests" {
            break;
        }
        if let Some((k, v)) = name.split_once('=')
            && names.contains(&k)
        {
            let v = percent_decode(v);
            let pair = HivePair {
                key: k.to_string(),
                value: (v != HIVE_NULL).then_some(v),
                folder: name.to_string(),
            };
            match out.iter().find(|p| p.key == k) {
                None => out.push(pair),
                Some(inner) if inner.value == pair.value => {}
                Some(inner) => {
                    return Err(Error::invalid(
                        Location::file(path).column(k),
                        format!(
                            "the file lies in folders `{}` and `{}`, which give column `{k}` different values",
                            pair.folder, inner.folder
                        ),
                        format!(
                            "which folder is right cannot be known: keep one `{k}=` folder on the file's path, or write the column into the file"
                        ),
                    ));
                }
            }
        }
        dir = d.parent();
    }
    out.reverse();
    Ok(out)
}

/// Hive writers escape `/`, `=`, `%` and a few others as `%XX`.
fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%'
            && i + 2 < b.len()
            && let Ok(hex) = std::str::from_utf8(&b[i + 1..i + 3])
            && let Ok(x) = u8::from_str_radix(hex, 16)
        {
            out.push(x);
            i += 3;
            continue;
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8(out).unwrap_or_else(|_| s.to_string())
}

/// A constant column for a folder value: an integer when it parses as one
/// (the reader's type checks then apply as to any column), else a string.
fn constant(value: &Option<String>, rows: usize) -> ArrayRef {
    match value {
        None => Arc::new(StringArray::new_null(rows)),
        Some(v) => {
            if let Ok(u) = v.parse::<u64>() {
                Arc::new(UInt64Array::from_value(u, rows))
            } else if let Ok(i) = v.parse::<i64>() {
                Arc::new(Int64Array::from(vec![i; rows]))
            } else {
                Arc::new(StringArray::from_iter_values(std::iter::repeat_n(v, rows)))
            }
        }
    }
}

/// Checks that the columns a batch has agree with their folders. `row0` is
/// the file row of the batch's first row (for messages). Run after the
/// batch's own row checks, so a row that is wrong in itself (an unknown pool
/// id) is named for that first.
pub(crate) fn check(batch: &RecordBatch, path: &Path, row0: u64, hive: &HivePairs) -> Result<()> {
    for p in hive {
        if let Some(col) = batch.column_by_name(&p.key) {
            check_agrees(col, &p.key, &p.value, path, row0)?;
        }
    }
    Ok(())
}

/// Adds the folder values of columns the batch lacks.
pub(crate) fn fill(batch: RecordBatch, path: &Path, hive: &HivePairs) -> Result<RecordBatch> {
    if hive.is_empty() {
        return Ok(batch);
    }
    let rows = batch.num_rows();
    let mut fields: Vec<Arc<Field>> = batch.schema().fields().iter().cloned().collect();
    let mut cols: Vec<ArrayRef> = batch.columns().to_vec();
    for p in hive {
        if batch.column_by_name(&p.key).is_none() {
            let c = constant(&p.value, rows);
            let mut meta = HashMap::from([(FOLDER_META.to_string(), p.folder.clone())]);
            if let Some(v) = &p.value {
                meta.insert(VALUE_META.to_string(), v.clone());
            }
            fields.push(Arc::new(
                Field::new(&p.key, c.data_type().clone(), true).with_metadata(meta),
            ));
            cols.push(c);
        }
    }
    if cols.len() == batch.num_columns() {
        return Ok(batch);
    }
    RecordBatch::try_new(
        Arc::new(Schema::new_with_metadata(
            fields,
            batch.schema().metadata().clone(),
        )),
        cols,
    )
    .map_err(|e| Error::Other(format!("{}: hive columns: {e}", path.display())))
}

fn check_agrees(
    col: &ArrayRef,
    key: &str,
    value: &Option<String>,
    path: &Path,
    row0: u64,
) -> Result<()> {
    let Some(v) = value else {
        return Ok(()); // a null folder says nothing about the rows
    };
    let mismatch = |i: usize| {
        let got = arrow_cast::display::ArrayFormatter::try_new(col.as_ref(), &Default::default())
            .map(|f| f.value(i).to_string())
            .unwrap_or_default();
        Err(Error::invalid(
            Location::file(path).row(row0 + i as u64).column(key),
            format!("the file lies in folder `{key}={v}` but this row's `{key}` is {got}"),
            "the Hive folder and the column contradict each other: move the file to the folder of its rows, or drop the column and let the folder say it",
        ))
    };
    if col.data_type().is_integer()
        && let Ok(want) = v.parse::<i64>()
    {
        // The common case (our own kv/pool=N/ files): compare as integers.
        let Ok(ints) = arrow_cast::cast(col.as_ref(), &DataType::Int64) else {
            return Ok(());
        };
        let ints = ints.as_primitive::<Int64Type>();
        for i in 0..col.len() {
            if col.is_valid(i) && (ints.is_null(i) || ints.value(i) != want) {
                return mismatch(i);
            }
        }
        return Ok(());
    }
    if !matches!(
        col.data_type(),
        DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View | DataType::Dictionary(_, _)
    ) {
        return Ok(()); // a type the column check will refuse or judge
    }
    let Ok(strs) = arrow_cast::cast(col.as_ref(), &DataType::Utf8) else {
        return Ok(());
    };
    let strs = strs.as_string::<i32>();
    for i in 0..col.len() {
        if col.is_valid(i) && strs.value(i) != v {
            return mismatch(i);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(key: &str, value: Option<&str>, folder: &str) -> HivePair {
        HivePair {
            key: key.to_string(),
            value: value.map(str::to_string),
            folder: folder.to_string(),
        }
    }

    #[test]
    fn pairs_below_the_table_root() {
        let p = Path::new("/t/run=3/trace/kv/date=x/pool=1/sub/part=2/f.parquet");
        assert_eq!(
            pairs(p, &["pool", "seq"]).unwrap(),
            vec![pair("pool", Some("1"), "pool=1")]
        );
        let p = Path::new("/t/trace/requests/tenant=a%2Fb/f.parquet");
        assert_eq!(
            pairs(p, &["tenant"]).unwrap(),
            vec![pair("tenant", Some("a/b"), "tenant=a%2Fb")]
        );
        let p = Path::new("/t/trace/kv/pool=__HIVE_DEFAULT_PARTITION__/f.parquet");
        assert_eq!(
            pairs(p, &["pool"]).unwrap(),
            vec![pair("pool", None, "pool=__HIVE_DEFAULT_PARTITION__")]
        );
    }

    #[test]
    fn nested_folders_of_one_key_agree_or_are_refused() {
        let p = Path::new("/t/kv/pool=1/pool=%31/f.parquet");
        assert_eq!(
            pairs(p, &["pool"]).unwrap(),
            vec![pair("pool", Some("1"), "pool=%31")]
        );
        let p = Path::new("/t/kv/pool=0/pool=1/f.parquet");
        let e = pairs(p, &["pool"]).unwrap_err().to_string();
        assert!(e.contains("`pool=0`") && e.contains("`pool=1`"), "{e}");
    }
}
