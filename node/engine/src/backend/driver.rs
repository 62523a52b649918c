//! Probe for the CUDA driver (`libcuda`) before anything touches burn-cuda:
//! cudarc dlopens the driver lazily and panics when it is missing, so a
//! worker started with `--gpu N` on a machine without one would abort
//! instead of saying why. The probe loads the library the same way cudarc
//! will, initialises it and reads the device list, so a bad index or a
//! driver that cannot see a GPU is a typed error too.

use std::ffi::{c_char, c_int, c_uint, CStr};

use libloading::Library;

use super::BackendError;

/// Names cudarc tries first on Linux (it also tries versioned variants of
/// these; a driver installed by NVIDIA's packages provides both).
pub const DRIVER_NAMES: &[&str] = &["libcuda.so.1", "libcuda.so"];

/// One CUDA device as the driver reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaDeviceInfo {
    pub index: u32,
    pub name: String,
    pub total_memory_bytes: u64,
    /// `cuDriverGetVersion`: 1000 * major + 10 * minor.
    pub driver_version: i32,
    /// The library file that was loaded.
    pub library: String,
}

type CuInit = unsafe extern "C" fn(c_uint) -> c_int;
type CuIntOut = unsafe extern "C" fn(*mut c_int) -> c_int;
type CuDeviceGet = unsafe extern "C" fn(*mut c_int, c_int) -> c_int;
type CuDeviceGetName = unsafe extern "C" fn(*mut c_char, c_int, c_int) -> c_int;
type CuDeviceTotalMem = unsafe extern "C" fn(*mut usize, c_int) -> c_int;

/// Probe the default driver names for device `index`.
pub fn probe_cuda(index: u32) -> Result<CudaDeviceInfo, BackendError> {
    probe_cuda_with(DRIVER_NAMES, index)
}

/// Probe with an explicit list of library names (tests use names that
/// cannot exist, or a library that is not a CUDA driver).
pub fn probe_cuda_with(names: &[&str], index: u32) -> Result<CudaDeviceInfo, BackendError> {
    let mut tried = Vec::with_capacity(names.len());
    for &name in names {
        // SAFETY: loading runs the library's initialisers; we only load the
        // names cudarc itself would load next (or, in tests, libm), so this
        // adds no code that would not run anyway.
        match unsafe { Library::new(name) } {
            Ok(lib) => return query(&lib, name, index),
            Err(e) => tried.push(format!("{name}: {e}")),
        }
    }
    Err(BackendError::NoCudaDriver { tried: tried.join("; ") })
}

/// Look a symbol up, as a typed error when the library lacks it.
fn sym<T: Copy>(lib: &Library, library: &str, name: &str) -> Result<T, BackendError> {
    // SAFETY: every `T` used here is the driver API's documented C
    // signature for `name` (cuda.h, CUDA 11+).
    unsafe { lib.get::<T>(name.as_bytes()) }.map(|s| *s).map_err(|e| BackendError::NotACudaDriver {
        library: library.to_string(),
        reason: format!("no symbol {name}: {e}"),
    })
}

fn check(call: &str, rc: c_int) -> Result<(), BackendError> {
    if rc == 0 {
        Ok(())
    } else {
        Err(BackendError::CudaCall { call: call.to_string(), code: rc })
    }
}

fn query(lib: &Library, library: &str, index: u32) -> Result<CudaDeviceInfo, BackendError> {
    let cu_init: CuInit = sym(lib, library, "cuInit")?;
    let cu_version: CuIntOut = sym(lib, library, "cuDriverGetVersion")?;
    let cu_count: CuIntOut = sym(lib, library, "cuDeviceGetCount")?;
    let cu_get: CuDeviceGet = sym(lib, library, "cuDeviceGet")?;
    let cu_name: CuDeviceGetName = sym(lib, library, "cuDeviceGetName")?;
    let cu_mem: CuDeviceTotalMem = sym(lib, library, "cuDeviceTotalMem_v2")?;
    let (mut version, mut count, mut dev, mut mem) = (0 as c_int, 0 as c_int, 0 as c_int, 0usize);
    let mut name = [0 as c_char; 256];
    // SAFETY: the out-pointers point at live locals of the declared types
    // and `name` holds the 256 bytes we pass as its length; the driver
    // writes a NUL-terminated string of at most that length.
    unsafe {
        check("cuInit", cu_init(0))?;
        check("cuDriverGetVersion", cu_version(&mut version))?;
        check("cuDeviceGetCount", cu_count(&mut count))?;
        if index as i64 >= count as i64 {
            return Err(BackendError::NoSuchGpu { index, count: count.max(0) as u32 });
        }
        check("cuDeviceGet", cu_get(&mut dev, index as c_int))?;
        check("cuDeviceGetName", cu_name(name.as_mut_ptr(), name.len() as c_int, dev))?;
        check("cuDeviceTotalMem_v2", cu_mem(&mut mem, dev))?;
    }
    name[name.len() - 1] = 0;
    // SAFETY: NUL-terminated above at the latest.
    let name = unsafe { CStr::from_ptr(name.as_ptr()) }.to_string_lossy().into_owned();
    Ok(CudaDeviceInfo {
        index,
        name,
        total_memory_bytes: mem as u64,
        driver_version: version,
        library: library.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_library_is_no_driver_and_names_every_try() {
        let err = probe_cuda_with(&["libgcs-no-such-driver.so.1", "libgcs-nope.so"], 0)
            .expect_err("cannot load");
        let msg = err.to_string();
        assert!(matches!(err, BackendError::NoCudaDriver { .. }), "{err:?}");
        assert!(msg.starts_with("no CUDA driver found"), "{msg}");
        assert!(
            msg.contains("libgcs-no-such-driver.so.1") && msg.contains("libgcs-nope.so"),
            "{msg}"
        );
    }

    #[test]
    fn a_library_without_the_driver_api_is_refused() {
        // libm loads everywhere glibc does, and has no cuInit.
        let err = probe_cuda_with(&["libgcs-nope.so", "libm.so.6"], 0).expect_err("not cuda");
        match &err {
            BackendError::NotACudaDriver { library, reason } => {
                assert_eq!(library, "libm.so.6");
                assert!(reason.contains("cuInit"), "{reason}");
            }
            other => panic!("expected NotACudaDriver, got {other:?}"),
        }
    }

    #[test]
    fn empty_name_list_is_no_driver() {
        assert!(matches!(probe_cuda_with(&[], 0), Err(BackendError::NoCudaDriver { .. })));
    }
}
