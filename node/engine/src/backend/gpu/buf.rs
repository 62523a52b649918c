//! Typed device buffers: a handle with its element count, so a kernel
//! argument's length always matches what was allocated.

use std::marker::PhantomData;

use cubecl::bytes::Bytes;
use cubecl::client::Client;
use cubecl::prelude::*;
use cubecl::server::Handle;
use cubecl::zspace::{Shape, Strides};

use super::GpuError;

/// `len` elements of `T` on the device.
#[derive(Debug, Clone)]
pub struct DeviceBuf<T> {
    handle: Handle,
    len: usize,
    _t: PhantomData<T>,
}

impl<T: CubeElement> DeviceBuf<T> {
    /// A copy of `data` on the device.
    pub fn upload(client: &Client, data: &[T]) -> Self {
        // An empty buffer still gets one element: backends refuse
        // zero-sized bindings, and `len` keeps kernels from reading it.
        if data.is_empty() {
            let mut b = Self::zeros(client, 1);
            b.len = 0;
            return b;
        }
        Self {
            handle: client.create_from_slice(T::as_bytes(data)),
            len: data.len(),
            _t: PhantomData,
        }
    }

    /// `len` elements, zeroed (zero bits are 0.0 for the float types).
    pub fn zeros(client: &Client, len: usize) -> Self {
        let zero = vec![0u8; len.max(1) * std::mem::size_of::<T>()];
        Self { handle: client.create_from_slice(&zero), len, _t: PhantomData }
    }

    /// `len` elements of unspecified content (a kernel's output).
    pub fn uninit(client: &Client, len: usize) -> Self {
        Self { handle: client.empty(len.max(1) * std::mem::size_of::<T>()), len, _t: PhantomData }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The buffer as a kernel argument.
    #[allow(unsafe_code)]
    pub fn arg(&self) -> BufferArg {
        // SAFETY: `len` is at most the number of `T`s the handle was
        // allocated with (set together in the constructors above).
        unsafe { BufferArg::from_raw_parts(self.handle.clone(), self.len) }
    }

    /// The buffer as a strided tensor (cubek's matmul): every element the
    /// shape and strides reach lies within `len`.
    #[allow(unsafe_code)]
    pub fn tensor(&self, shape: Shape, strides: Strides) -> TensorBinding {
        let last: usize =
            shape.iter().zip(strides.iter()).map(|(d, s)| d.saturating_sub(1) * s).sum();
        assert!(shape.iter().all(|&d| d > 0) && last < self.len, "a tensor past its buffer");
        // SAFETY: every index the shape and strides reach is below `len`
        // (asserted), the number of `T`s the handle holds.
        unsafe { TensorBinding::from_raw_parts(self.handle.clone(), strides, shape) }
    }

    /// Overwrite the buffer's first `data.len()` elements in place (the
    /// same device memory: how a captured graph's inputs are refreshed),
    /// ordered on the calling thread's stream like the launches.
    pub fn write(&self, client: &Client, data: &[T]) {
        debug_assert!(data.len() <= self.len.max(1));
        client.write(&self.handle, Bytes::from_bytes_vec(T::as_bytes(data).to_vec()));
    }

    /// Rows `rows` of the buffer taken as rows of `row_len` elements, one
    /// after another: one read (one wait) for all, each run of adjacent
    /// rows copied as one range.
    pub fn read_rows(
        &self,
        client: &Client,
        row_len: usize,
        rows: &[usize],
    ) -> Result<Vec<T>, GpuError> {
        let bytes = client.read(self.row_ranges(row_len, rows)?).map_err(GpuError::server)?;
        Ok(Self::decode(&bytes))
    }

    /// The ranges [`DeviceBuf::read_rows`] reads, for a read of several
    /// buffers at once (decoded with [`DeviceBuf::decode`]).
    pub fn row_ranges(&self, row_len: usize, rows: &[usize]) -> Result<Vec<Handle>, GpuError> {
        let mut runs: Vec<(usize, usize)> = vec![];
        for &r in rows {
            match runs.last_mut() {
                Some((_, end)) if *end == r => *end += 1,
                _ => runs.push((r, r + 1)),
            }
        }
        if runs.iter().any(|&(_, end)| end * row_len > self.len) {
            return Err(GpuError::Unsupported(format!("rows {rows:?} past the buffer")));
        }
        let spans: Vec<_> = runs.iter().map(|&(a, b)| a * row_len..b * row_len).collect();
        self.ranges(&spans)
    }

    /// Element ranges of the buffer, for a read of several at once (none
    /// for an empty range: decoded with [`DeviceBuf::decode`], an empty
    /// one reads as nothing).
    pub fn ranges(&self, spans: &[std::ops::Range<usize>]) -> Result<Vec<Handle>, GpuError> {
        if let Some(s) = spans.iter().find(|s| s.end > self.len || s.start > s.end) {
            return Err(GpuError::Unsupported(format!("range {s:?} past the buffer")));
        }
        // Offsets add to the handle's own: an allocation may be a padded
        // slice of a larger one.
        let (size, elem) = (self.handle.size_in_used(), std::mem::size_of::<T>() as u64);
        Ok(spans
            .iter()
            .filter(|s| !s.is_empty())
            .map(|s| {
                let (a, b) = (s.start as u64 * elem, s.end as u64 * elem);
                self.handle.clone().offset_start(a).offset_end(size - b)
            })
            .collect())
    }

    /// The elements of ranges read back, one after another.
    pub fn decode(bytes: &[Bytes]) -> Vec<T> {
        bytes.iter().flat_map(|b| T::from_bytes(b).iter().copied()).collect()
    }

    /// Copy the buffer back to the host (waits for the kernels writing it).
    pub fn read(&self, client: &Client) -> Result<Vec<T>, GpuError> {
        let bytes = client.read_one(self.handle.clone()).map_err(GpuError::server)?;
        let mut v = T::from_bytes(&bytes).to_vec();
        v.truncate(self.len);
        Ok(v)
    }
}
