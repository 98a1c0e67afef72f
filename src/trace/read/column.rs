//! One column of a batch with its location: typed extraction, every
//! value checked against the contract, an error naming file, row and
//! column.

use std::borrow::Cow;
use std::path::Path;

use arrow_array::cast::AsArray;
use arrow_array::types::*;
use arrow_array::{Array, ArrayRef, RecordBatch, StringArray};
use arrow_buffer::NullBuffer;
use arrow_schema::{DataType, TimeUnit};

use crate::error::{Error, Location, Result};
use crate::schema::Op;
use crate::trace::hive::{self};

/// A text column's values as read ([`Col::texts`]): every row the same
/// (a Hive folder's value, or null), or the column itself as Utf8.
pub(crate) enum Texts {
    Same(Option<String>),
    Utf8(StringArray),
}

impl Texts {
    /// Row `i`'s text (None: null).
    #[inline]
    pub(crate) fn get(&self, i: usize) -> Option<&str> {
        match self {
            Texts::Same(v) => v.as_deref(),
            Texts::Utf8(s) => s.is_valid(i).then(|| s.value(i)),
        }
    }
}

/// A column of a batch with its location, for typed extraction.
pub(crate) struct Col<'a> {
    pub(crate) path: &'a Path,
    pub(crate) name: &'static str,
    pub(crate) row0: u64,
    pub(crate) arr: Option<&'a ArrayRef>,
    /// For a column the file lacks, filled in from a Hive folder: the
    /// folder's name and its value (None: Hive's null).
    pub(crate) folder: Option<(String, Option<String>)>,
}

impl<'a> Col<'a> {
    pub(crate) fn get(
        batch: &'a RecordBatch,
        path: &'a Path,
        row0: u64,
        name: &'static str,
    ) -> Col<'a> {
        let folder = batch.schema_ref().field_with_name(name).ok().and_then(|f| {
            let m = f.metadata();
            Some((
                m.get(hive::FOLDER_META)?.clone(),
                m.get(hive::VALUE_META).cloned(),
            ))
        });
        Col {
            path,
            name,
            row0,
            arr: batch.column_by_name(name),
            folder,
        }
    }

    /// A column filled in from a Hive folder holds the folder's value in
    /// every row, so any error in it is the folder's: it names the folder
    /// and the value instead of a row and the column's type.
    pub(crate) fn blame_folder<T>(&self, res: Result<T>, expected: &str) -> Result<T> {
        match (&res, &self.folder) {
            (Err(_), Some((folder, value))) => {
                let value = match value {
                    Some(v) => format!("{v:?}"),
                    None => "null".to_string(),
                };
                Err(Error::invalid(
                    Location::file(self.path).column(self.name),
                    format!(
                        "the file lies in folder `{folder}`, which gives column `{}` the value {value}: not a {expected}",
                        self.name
                    ),
                    format!(
                        "rename the folder to `{}=` and a value of the contract's type (docs/trace-format.md), or write the column into the file",
                        self.name
                    ),
                ))
            }
            _ => res,
        }
    }

    pub(crate) fn loc(&self, row: usize) -> Location {
        Location::file(self.path)
            .row(self.row0 + row as u64)
            .column(self.name)
    }

    pub(crate) fn type_error(&self, expected: &str) -> Error {
        let dt = self
            .arr
            .map(|a| a.data_type().to_string())
            .unwrap_or_default();
        Error::invalid(
            Location::file(self.path).column(self.name),
            format!("column `{}` has type {dt}, expected {expected}", self.name),
            "write the column with the type the v1 contract gives (docs/trace-format.md)",
        )
    }

    /// Errors on the first null if the column is declared non-null.
    pub(crate) fn check_no_nulls(&self) -> Result<()> {
        self.blame_folder(
            self.check_no_nulls_inner(),
            "value (the column is non-null)",
        )
    }

    pub(crate) fn check_no_nulls_inner(&self) -> Result<()> {
        if let Some(a) = self.arr
            && let Some(nb) = a.logical_nulls()
            && nb.null_count() > 0
        {
            let row = (0..a.len()).find(|&i| nb.is_null(i)).unwrap_or(0);
            return Err(Error::invalid(
                self.loc(row),
                format!("null in non-null column `{}`", self.name),
                "every row needs a value in this column (docs/trace-format.md)",
            ));
        }
        Ok(())
    }

    pub(crate) fn nulls(&self) -> Option<NullBuffer> {
        self.arr.and_then(|a| a.logical_nulls())
    }

    /// Integer values converted to `T`, rejecting values out of range.
    /// Any integer type is accepted if the values fit (writers differ in
    /// integer widths); other types are an error.
    pub(crate) fn ints<T>(&self, expected: &str) -> Result<Cow<'a, [T]>>
    where
        T: ArrowNativeTypeExt,
    {
        self.blame_folder(self.ints_inner(expected), expected)
    }

    pub(crate) fn ints_inner<T>(&self, expected: &str) -> Result<Cow<'a, [T]>>
    where
        T: ArrowNativeTypeExt,
    {
        let a = self.arr.expect("column present");
        if let Some(s) = T::borrow(a) {
            return Ok(Cow::Borrowed(s));
        }
        let nulls = a.logical_nulls();
        macro_rules! conv {
            ($ty:ty) => {{
                let v = a.as_primitive::<$ty>().values();
                let mut out = Vec::with_capacity(v.len());
                for (i, x) in v.iter().enumerate() {
                    let valid = nulls.as_ref().map(|n| n.is_valid(i)).unwrap_or(true);
                    match T::from_i128(*x as i128) {
                        Some(t) => out.push(t),
                        None if !valid => out.push(T::default()),
                        None => {
                            return Err(Error::invalid(
                                self.loc(i),
                                format!(
                                    "value {x} does not fit column `{}` ({expected})",
                                    self.name
                                ),
                                "write values in the range of the contract's type",
                            ));
                        }
                    }
                }
                Ok(Cow::Owned(out))
            }};
        }
        match a.data_type() {
            // A column with no value at all (pyarrow writes an all-None
            // column as type null): nulls, checked by the caller.
            DataType::Null => Ok(Cow::Owned(vec![T::default(); a.len()])),
            // Dictionary-encoded integers (a pandas Categorical): the values.
            DataType::Dictionary(_, v) if v.is_integer() => {
                let plain = arrow_cast::cast(a, v).map_err(|e| self.type_error(&e.to_string()))?;
                let col = Col {
                    path: self.path,
                    name: self.name,
                    row0: self.row0,
                    arr: Some(&plain),
                    folder: None,
                };
                Ok(Cow::Owned(col.ints::<T>(expected)?.into_owned()))
            }
            // Epoch timestamps (pandas datetime64, `timestamp[ns]`) for the
            // Int64 nanosecond columns: the same numbers, scaled to ns.
            DataType::Timestamp(unit, _) if expected == "Int64" => {
                let scale: i128 = match unit {
                    TimeUnit::Second => 1_000_000_000,
                    TimeUnit::Millisecond => 1_000_000,
                    TimeUnit::Microsecond => 1_000,
                    TimeUnit::Nanosecond => 1,
                };
                let raw: &[i64] = match unit {
                    TimeUnit::Second => a.as_primitive::<TimestampSecondType>().values(),
                    TimeUnit::Millisecond => a.as_primitive::<TimestampMillisecondType>().values(),
                    TimeUnit::Microsecond => a.as_primitive::<TimestampMicrosecondType>().values(),
                    TimeUnit::Nanosecond => a.as_primitive::<TimestampNanosecondType>().values(),
                };
                let mut out = Vec::with_capacity(raw.len());
                for (i, x) in raw.iter().enumerate() {
                    let valid = nulls.as_ref().map(|n| n.is_valid(i)).unwrap_or(true);
                    match T::from_i128(*x as i128 * scale) {
                        Some(t) => out.push(t),
                        None if !valid => out.push(T::default()),
                        None => {
                            return Err(Error::invalid(
                                self.loc(i),
                                format!(
                                    "timestamp {x} ({unit:?}) does not fit column `{}` in nanoseconds",
                                    self.name
                                ),
                                "write Unix epoch nanoseconds as Int64",
                            ));
                        }
                    }
                }
                Ok(Cow::Owned(out))
            }
            // Decimal(p, 0): how writers without unsigned 64-bit integers
            // (Spark) keep ids above 2^63.
            DataType::Decimal128(_, 0) => conv!(Decimal128Type),
            DataType::Int8 => conv!(Int8Type),
            DataType::Int16 => conv!(Int16Type),
            DataType::Int32 => conv!(Int32Type),
            DataType::Int64 => conv!(Int64Type),
            DataType::UInt8 => conv!(UInt8Type),
            DataType::UInt16 => conv!(UInt16Type),
            DataType::UInt32 => conv!(UInt32Type),
            DataType::UInt64 => conv!(UInt64Type),
            _ => Err(self.type_error(expected)),
        }
    }

    /// String column (Utf8, LargeUtf8, Utf8View or a dictionary of them).
    pub(crate) fn strings(&self) -> Result<Vec<Option<String>>> {
        let s = self.texts()?;
        let n = self.arr.map_or(0, |a| a.len());
        Ok((0..n).map(|i| s.get(i).map(str::to_string)).collect())
    }

    /// The column's text, row by row, without a copy of each value.
    pub(crate) fn texts(&self) -> Result<Texts> {
        self.blame_folder(self.texts_inner(), "Utf8")
    }

    fn texts_inner(&self) -> Result<Texts> {
        let a = self.arr.expect("column present");
        // A folder's value is text as written (`tenant=007/` is "007"),
        // though the folder column is an integer when it parses as one.
        if let Some((_, value)) = &self.folder {
            return Ok(Texts::Same(value.clone()));
        }
        let is_str = |dt: &DataType| {
            matches!(
                dt,
                DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View
            )
        };
        if a.data_type() == &DataType::Null {
            return Ok(Texts::Same(None));
        }
        let ok = match a.data_type() {
            DataType::Dictionary(_, v) => is_str(v),
            dt => is_str(dt),
        };
        if !ok {
            return Err(self.type_error("Utf8"));
        }
        let c =
            arrow_cast::cast(a, &DataType::Utf8).map_err(|e| self.type_error(&e.to_string()))?;
        Ok(Texts::Utf8(c.as_string::<i32>().clone()))
    }

    /// The op column as codes: dictionary values are parsed once.
    pub(crate) fn ops(&self) -> Result<Vec<Op>> {
        self.blame_folder(self.ops_inner(), "op")
    }

    pub(crate) fn ops_inner(&self) -> Result<Vec<Op>> {
        let a = self.arr.expect("column present");
        let bad = |row: usize, v: &str| {
            Error::invalid(
                self.loc(row),
                format!("unknown op {v:?}"),
                "op must be one of alloc, write, read, free, share, scrub (lower case)",
            )
        };
        if let Some(dict) = a.as_any_dictionary_opt() {
            let values = Col {
                path: self.path,
                name: self.name,
                row0: self.row0,
                arr: Some(dict.values()),
                folder: None,
            }
            .strings()?;
            let codes: Vec<Option<Op>> = values
                .iter()
                .map(|v| v.as_deref().and_then(Op::parse))
                .collect();
            let keys = dict.normalized_keys();
            let mut out = Vec::with_capacity(keys.len());
            for (i, k) in keys.iter().enumerate() {
                match codes.get(*k).copied().flatten() {
                    Some(op) => out.push(op),
                    None => {
                        return Err(bad(
                            i,
                            values.get(*k).and_then(|v| v.as_deref()).unwrap_or(""),
                        ));
                    }
                }
            }
            return Ok(out);
        }
        // Plain strings: parse in place, without one String per row.
        let mut out = Vec::with_capacity(a.len());
        let mut push = |i: usize, s: Option<&str>| -> Result<()> {
            let s = s.unwrap_or("");
            out.push(Op::parse(s).ok_or_else(|| bad(i, s))?);
            Ok(())
        };
        match a.data_type() {
            DataType::Utf8 => {
                for (i, s) in a.as_string::<i32>().iter().enumerate() {
                    push(i, s)?;
                }
            }
            DataType::LargeUtf8 => {
                for (i, s) in a.as_string::<i64>().iter().enumerate() {
                    push(i, s)?;
                }
            }
            DataType::Utf8View => {
                for (i, s) in a.as_string_view().iter().enumerate() {
                    push(i, s)?;
                }
            }
            // no rows, or all null (refused before this by the null check)
            DataType::Null => out.resize(a.len(), Op::Alloc),
            _ => return Err(self.type_error("Utf8")),
        }
        Ok(out)
    }

    /// FixedSizeBinary(32) (or Binary of 32-byte values).
    pub(crate) fn hashes(&self) -> Result<Vec<Option<[u8; 32]>>> {
        self.blame_folder(self.hashes_inner(), "FixedSizeBinary(32)")
    }

    pub(crate) fn hashes_inner(&self) -> Result<Vec<Option<[u8; 32]>>> {
        let a = self.arr.expect("column present");
        let mut out = Vec::with_capacity(a.len());
        let mut push = |i: usize, v: Option<&[u8]>| -> Result<()> {
            match v {
                None => out.push(None),
                Some(b) => out.push(Some(b.try_into().map_err(|_| {
                    Error::invalid(
                        self.loc(i),
                        format!("hash has {} bytes, expected 32", b.len()),
                        "hashes are blake3 digests: 32 bytes",
                    )
                })?)),
            }
            Ok(())
        };
        match a.data_type() {
            DataType::FixedSizeBinary(_) => {
                for (i, v) in a.as_fixed_size_binary().iter().enumerate() {
                    push(i, v)?;
                }
            }
            DataType::Binary => {
                for (i, v) in a.as_binary::<i32>().iter().enumerate() {
                    push(i, v)?;
                }
            }
            DataType::LargeBinary => {
                for (i, v) in a.as_binary::<i64>().iter().enumerate() {
                    push(i, v)?;
                }
            }
            DataType::Null => out.resize(a.len(), None),
            _ => return Err(self.type_error("FixedSizeBinary(32)")),
        }
        Ok(out)
    }
}

/// Native integer types we convert columns into.
pub trait ArrowNativeTypeExt: Copy + Default + 'static {
    fn from_i128(v: i128) -> Option<Self>;
    fn borrow(a: &ArrayRef) -> Option<&[Self]>;
}

macro_rules! native {
    ($t:ty, $arrow:ty) => {
        impl ArrowNativeTypeExt for $t {
            fn from_i128(v: i128) -> Option<Self> {
                <$t>::try_from(v).ok()
            }
            fn borrow(a: &ArrayRef) -> Option<&[Self]> {
                a.as_primitive_opt::<$arrow>().map(|p| &p.values()[..])
            }
        }
    };
}
native!(u16, UInt16Type);
native!(u32, UInt32Type);
native!(u64, UInt64Type);
native!(i64, Int64Type);

pub(crate) fn opt<T: Copy>(
    vals: &Option<Cow<[T]>>,
    nulls: &Option<NullBuffer>,
    i: usize,
) -> Option<T> {
    let v = vals.as_ref()?;
    if let Some(n) = nulls
        && n.is_null(i)
    {
        return None;
    }
    Some(v[i])
}
