//! A trace file opened for reading, local or remote: what the Parquet
//! reader, the digests and the manifest reader take.

use std::fs::File;
use std::io::{self, BufReader, Read};

use bytes::Bytes;
use parquet::file::reader::{ChunkReader, Length};

use crate::trace::store::object::{RangeReader, RemoteFile};

/// A data file or trace.json opened for reading, local or remote: what
/// the Parquet reader, the digests and the manifest reader take.
pub enum Source {
    Local(File),
    Remote(RemoteFile),
}

impl Source {
    /// The file's length in bytes.
    pub fn size(&self) -> io::Result<u64> {
        match self {
            Source::Local(f) => Ok(f.metadata()?.len()),
            Source::Remote(r) => Ok(r.len()),
        }
    }
}

impl Read for Source {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Source::Local(f) => f.read(buf),
            Source::Remote(r) => r.read(buf),
        }
    }
}

/// The reader [`Source`] hands the Parquet reader from an offset.
pub enum SourceRead {
    Local(BufReader<File>),
    Remote(RangeReader),
}

impl Read for SourceRead {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            SourceRead::Local(f) => f.read(buf),
            SourceRead::Remote(r) => r.read(buf),
        }
    }
}

impl Length for Source {
    fn len(&self) -> u64 {
        match self {
            Source::Local(f) => Length::len(f),
            Source::Remote(r) => r.len(),
        }
    }
}

impl ChunkReader for Source {
    type T = SourceRead;

    fn get_read(&self, start: u64) -> parquet::errors::Result<SourceRead> {
        match self {
            Source::Local(f) => f.get_read(start).map(SourceRead::Local),
            Source::Remote(r) => Ok(SourceRead::Remote(r.reader_at(start))),
        }
    }

    fn get_bytes(&self, start: u64, length: usize) -> parquet::errors::Result<Bytes> {
        match self {
            Source::Local(f) => f.get_bytes(start, length),
            Source::Remote(r) => {
                let bytes = r
                    .read_at(start, length as u64)
                    .map_err(|e| parquet::errors::ParquetError::External(Box::new(e)))?;
                if bytes.len() < length {
                    return Err(parquet::errors::ParquetError::EOF(format!(
                        "expected to read {length} bytes at offset {start}, got {}",
                        bytes.len()
                    )));
                }
                Ok(bytes)
            }
        }
    }
}
