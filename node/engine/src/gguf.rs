//! Minimal GGUF (v2/v3) parser: header, metadata key/values, tensor infos
//! and tensor data. All reads are bounds-checked so corrupt or truncated
//! files produce a [`GgufError`] instead of a panic.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::error::GgufError;
use crate::quant::dequantize;
pub use crate::quant::GgmlType;

const GGUF_MAGIC: u32 = 0x4655_4747; // "GGUF" little endian
const DEFAULT_ALIGNMENT: usize = 32;

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
}

impl Value {
    /// Integer value widened to i64 where the type is integral.
    pub fn as_i64(&self) -> Option<i64> {
        Some(match *self {
            Value::U8(v) => v as i64,
            Value::I8(v) => v as i64,
            Value::U16(v) => v as i64,
            Value::I16(v) => v as i64,
            Value::U32(v) => v as i64,
            Value::I32(v) => v as i64,
            Value::U64(v) => i64::try_from(v).ok()?,
            Value::I64(v) => v,
            Value::Bool(v) => v as i64,
            _ => return None,
        })
    }
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v as f64),
            Value::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// Description of one tensor in the file.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    /// ggml order: dims[0] is the fastest-varying (row length).
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Offset relative to the start of the data section.
    pub offset: u64,
    /// Size in bytes of the tensor data.
    pub size: usize,
}

impl TensorInfo {
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }
}

/// A parsed GGUF file with its bytes held in memory.
pub struct GgufFile {
    pub path: PathBuf,
    pub version: u32,
    pub metadata: HashMap<String, Value>,
    pub tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    data: Vec<u8>,
    data_start: usize,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("n_metadata", &self.metadata.len())
            .field("n_tensors", &self.tensors.len())
            .finish()
    }
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], GgufError> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len());
        match end {
            Some(end) => {
                let s = &self.buf[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            None => {
                Err(GgufError::Truncated { path: self.path.to_path_buf(), what, offset: self.pos })
            }
        }
    }
    fn u8(&mut self, what: &'static str) -> Result<u8, GgufError> {
        Ok(self.take(1, what)?[0])
    }
    fn u16(&mut self, what: &'static str) -> Result<u16, GgufError> {
        let b = self.take(2, what)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    #[allow(clippy::expect_used)] // the expect guards an invariant of the code right here
    fn u32(&mut self, what: &'static str) -> Result<u32, GgufError> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes(b.try_into().expect("4 bytes")))
    }
    #[allow(clippy::expect_used)] // the expect guards an invariant of the code right here
    fn u64(&mut self, what: &'static str) -> Result<u64, GgufError> {
        let b = self.take(8, what)?;
        Ok(u64::from_le_bytes(b.try_into().expect("8 bytes")))
    }
    fn len(&mut self, what: &'static str, min_elem_size: usize) -> Result<usize, GgufError> {
        let n = self.u64(what)?;
        // A length can never exceed what is left in the file; checking here
        // stops corrupt lengths from triggering huge allocations.
        let remaining = (self.buf.len() - self.pos) as u64;
        if n.saturating_mul(min_elem_size.max(1) as u64) > remaining {
            return Err(GgufError::Truncated {
                path: self.path.to_path_buf(),
                what,
                offset: self.pos,
            });
        }
        Ok(n as usize)
    }
    fn string(&mut self, what: &'static str) -> Result<String, GgufError> {
        let n = self.len(what, 1)?;
        let b = self.take(n, what)?;
        String::from_utf8(b.to_vec()).map_err(|_| GgufError::Malformed {
            path: self.path.to_path_buf(),
            reason: format!("{what} is not valid UTF-8"),
        })
    }

    fn value(&mut self, ty: u32, depth: u32) -> Result<Value, GgufError> {
        Ok(match ty {
            0 => Value::U8(self.u8("u8 value")?),
            1 => Value::I8(self.u8("i8 value")? as i8),
            2 => Value::U16(self.u16("u16 value")?),
            3 => Value::I16(self.u16("i16 value")? as i16),
            4 => Value::U32(self.u32("u32 value")?),
            5 => Value::I32(self.u32("i32 value")? as i32),
            6 => Value::F32(f32::from_bits(self.u32("f32 value")?)),
            7 => Value::Bool(self.u8("bool value")? != 0),
            8 => Value::String(self.string("string value")?),
            9 => {
                if depth > 4 {
                    return Err(self.malformed("arrays nested too deeply".into()));
                }
                let elem_ty = self.u32("array element type")?;
                let min = match elem_ty {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    _ => 8,
                };
                let n = self.len("array length", min)?;
                let mut out = Vec::with_capacity(n);
                for _ in 0..n {
                    out.push(self.value(elem_ty, depth + 1)?);
                }
                Value::Array(out)
            }
            10 => Value::U64(self.u64("u64 value")?),
            11 => Value::I64(self.u64("i64 value")? as i64),
            12 => Value::F64(f64::from_bits(self.u64("f64 value")?)),
            other => return Err(self.malformed(format!("unknown metadata value type {other}"))),
        })
    }

    fn malformed(&self, reason: String) -> GgufError {
        GgufError::Malformed { path: self.path.to_path_buf(), reason }
    }
}

impl GgufFile {
    /// Read and parse a GGUF file.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, GgufError> {
        let path = path.as_ref();
        let data = std::fs::read(path)
            .map_err(|source| GgufError::Io { path: path.to_path_buf(), source })?;
        Self::from_bytes(path, data)
    }

    /// Parse GGUF bytes; `path` is only used in error messages.
    pub fn from_bytes(path: impl AsRef<Path>, data: Vec<u8>) -> Result<Self, GgufError> {
        let path = path.as_ref();
        let mut c = Cursor { buf: &data, pos: 0, path };
        let magic = c.u32("magic")?;
        if magic != GGUF_MAGIC {
            return Err(GgufError::BadMagic { path: path.to_path_buf(), magic });
        }
        let version = c.u32("version")?;
        if !(2..=3).contains(&version) {
            return Err(GgufError::UnsupportedVersion { path: path.to_path_buf(), version });
        }
        // Minimum encoded sizes: a tensor info is >= 8+4+4+8 bytes, a kv >= 8+4+1.
        let n_tensors = c.len("tensor count", 24)?;
        let n_kv = c.len("metadata count", 13)?;

        let mut metadata = HashMap::with_capacity(n_kv);
        for _ in 0..n_kv {
            let key = c.string("metadata key")?;
            let ty = c.u32("metadata type")?;
            let v = c.value(ty, 0)?;
            metadata.insert(key, v);
        }

        let alignment = match metadata.get("general.alignment") {
            Some(v) => match v.as_i64() {
                Some(a) if a > 0 && (a as u64).is_power_of_two() && a <= 1 << 20 => a as usize,
                _ => return Err(c.malformed(format!("bad general.alignment {v:?}"))),
            },
            None => DEFAULT_ALIGNMENT,
        };

        let mut tensors = Vec::with_capacity(n_tensors);
        let mut tensor_index = HashMap::with_capacity(n_tensors);
        for _ in 0..n_tensors {
            let name = c.string("tensor name")?;
            let n_dims = c.u32("tensor n_dims")? as usize;
            if n_dims == 0 || n_dims > 4 {
                return Err(c.malformed(format!("tensor {name}: {n_dims} dims")));
            }
            let mut dims = Vec::with_capacity(n_dims);
            for _ in 0..n_dims {
                dims.push(c.u64("tensor dim")?);
            }
            let raw_ty = c.u32("tensor type")?;
            let offset = c.u64("tensor offset")?;
            let ggml_type =
                GgmlType::from_u32(raw_ty).ok_or_else(|| GgufError::UnsupportedType {
                    path: path.to_path_buf(),
                    name: name.clone(),
                    ggml_type: raw_ty,
                })?;
            let n_el = dims
                .iter()
                .try_fold(1u64, |a, &d| a.checked_mul(d))
                .filter(|&n| n > 0 && n < (1u64 << 40))
                .ok_or_else(|| c.malformed(format!("tensor {name}: bad dims {dims:?}")))?;
            let (blk, blk_bytes) = ggml_type.block_layout();
            if dims[0] % blk as u64 != 0 {
                return Err(c.malformed(format!(
                    "tensor {name}: row length {} not a multiple of block size {blk}",
                    dims[0]
                )));
            }
            let size = (n_el / blk as u64) as usize * blk_bytes;
            tensor_index.insert(name.clone(), tensors.len());
            tensors.push(TensorInfo { name, dims, ggml_type, offset, size });
        }

        let data_start = c.pos.div_ceil(alignment) * alignment;
        let data_len = data.len().saturating_sub(data_start);
        for t in &tensors {
            let end = t.offset.checked_add(t.size as u64);
            if end.is_none_or(|e| e > data_len as u64) {
                return Err(GgufError::Truncated {
                    path: path.to_path_buf(),
                    what: "tensor data",
                    offset: data_start.saturating_add(t.offset as usize),
                });
            }
            if !(t.offset as usize).is_multiple_of(alignment) {
                return Err(c.malformed(format!("tensor {} offset not aligned", t.name)));
            }
        }
        tracing::debug!(path = %path.display(), version, n_tensors, n_kv, "parsed gguf");
        Ok(Self {
            path: path.to_path_buf(),
            version,
            metadata,
            tensors,
            tensor_index,
            data,
            data_start,
        })
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    fn missing(&self, key: &str) -> GgufError {
        GgufError::MissingKey { path: self.path.clone(), key: key.to_string() }
    }

    pub fn get_u64(&self, key: &str) -> Result<u64, GgufError> {
        self.get(key)
            .and_then(Value::as_i64)
            .and_then(|v| u64::try_from(v).ok())
            .ok_or_else(|| self.missing(key))
    }
    pub fn get_f32(&self, key: &str) -> Result<f32, GgufError> {
        self.get(key).and_then(Value::as_f64).map(|v| v as f32).ok_or_else(|| self.missing(key))
    }
    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        self.get(key).and_then(Value::as_str).ok_or_else(|| self.missing(key))
    }
    pub fn get_array(&self, key: &str) -> Result<&[Value], GgufError> {
        self.get(key).and_then(Value::as_array).ok_or_else(|| self.missing(key))
    }

    pub fn tensor_info(&self, name: &str) -> Result<&TensorInfo, GgufError> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i]).ok_or_else(|| {
            GgufError::MissingTensor { path: self.path.clone(), name: name.to_string() }
        })
    }

    /// Raw bytes of a tensor (bounds were validated at parse time).
    pub fn tensor_bytes(&self, info: &TensorInfo) -> &[u8] {
        let start = self.data_start + info.offset as usize;
        &self.data[start..start + info.size]
    }

    /// Decode a tensor to f32 (only used for small tensors such as norms).
    pub fn tensor_f32(&self, name: &str) -> Result<Vec<f32>, GgufError> {
        let info = self.tensor_info(name)?;
        Ok(dequantize(info.ggml_type, self.tensor_bytes(info)))
    }
}
