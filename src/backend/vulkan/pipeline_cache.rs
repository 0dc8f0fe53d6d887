//! The persisted `VkPipelineCache`: a file under the user's cache directory holding our own header
//! (vendor, device, driver, pipeline-cache UUID, shader-set hash, length, checksum) before the
//! driver's blob. A file that is stale, corrupt or truncated is ignored and rewritten.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

const MAGIC: &[u8; 8] = b"MKVKPC01";
const HEADER_BYTES: usize = 8 + 4 * 4 + 16 + 8 * 3;

/// What a cached blob must have been made by to be reused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheKey {
    pub vendor_id: u32,
    pub device_id: u32,
    pub driver_version: u32,
    pub pipeline_cache_uuid: [u8; 16],
    pub shader_set_hash: u64,
}

pub use crate::backend::cache_dir;

/// The cache file for one device.
pub fn cache_path(key: &CacheKey) -> Option<PathBuf> {
    cache_dir().map(|d| d.join(format!("vulkan-pipelines-{:04x}-{:04x}.bin", key.vendor_id, key.device_id)))
}

fn fnv64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3))
}

/// Header + blob.
pub fn encode(key: &CacheKey, blob: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_BYTES + blob.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&key.vendor_id.to_le_bytes());
    out.extend_from_slice(&key.device_id.to_le_bytes());
    out.extend_from_slice(&key.driver_version.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend_from_slice(&key.pipeline_cache_uuid);
    out.extend_from_slice(&key.shader_set_hash.to_le_bytes());
    out.extend_from_slice(&(blob.len() as u64).to_le_bytes());
    out.extend_from_slice(&fnv64(blob).to_le_bytes());
    out.extend_from_slice(blob);
    out
}

/// The blob, if the file was written for `key` and is intact; `Err` says why not.
pub fn decode(key: &CacheKey, file: &[u8]) -> std::result::Result<Vec<u8>, &'static str> {
    if file.len() < HEADER_BYTES {
        return Err("truncated header");
    }
    if &file[..8] != MAGIC {
        return Err("bad magic");
    }
    let u32_at = |i: usize| u32::from_le_bytes([file[i], file[i + 1], file[i + 2], file[i + 3]]);
    let u64_at = |i: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&file[i..i + 8]);
        u64::from_le_bytes(b)
    };
    if u32_at(8) != key.vendor_id || u32_at(12) != key.device_id || u32_at(16) != key.driver_version {
        return Err("made by another device or driver");
    }
    if file[24..40] != key.pipeline_cache_uuid {
        return Err("pipeline-cache UUID changed");
    }
    if u64_at(40) != key.shader_set_hash {
        return Err("kernels changed");
    }
    let length = u64_at(48) as usize;
    let blob = &file[HEADER_BYTES..];
    if blob.len() != length {
        return Err("truncated blob");
    }
    if fnv64(blob) != u64_at(56) {
        return Err("checksum mismatch");
    }
    Ok(blob.to_vec())
}

/// Reads the blob for `key` from `path`, or nothing (missing, stale or corrupt files are ignored).
pub fn load(path: &Path, key: &CacheKey) -> Option<Vec<u8>> {
    let file = std::fs::read(path).ok()?;
    decode(key, &file).ok()
}

/// Writes atomically: a temporary file in the same directory, then a rename.
pub fn store(path: &Path, key: &CacheKey, blob: &[u8]) -> Result<()> {
    let fail = |reason: String| Error::PipelineCache { path: path.to_path_buf(), reason };
    let dir = path.parent().ok_or_else(|| fail("no parent directory".into()))?;
    std::fs::create_dir_all(dir).map_err(|e| fail(e.to_string()))?;
    let temporary = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&temporary, encode(key, blob)).map_err(|e| fail(e.to_string()))?;
    std::fs::rename(&temporary, path).map_err(|e| fail(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> CacheKey {
        CacheKey { vendor_id: 1, device_id: 2, driver_version: 3, pipeline_cache_uuid: [7; 16], shader_set_hash: 9 }
    }

    #[test]
    fn round_trip_and_rejections() {
        let blob = vec![1u8, 2, 3, 4, 5];
        let file = encode(&key(), &blob);
        assert_eq!(decode(&key(), &file).unwrap(), blob);
        assert!(decode(&key(), &file[..file.len() - 1]).is_err(), "truncated");
        assert!(decode(&key(), &file[..10]).is_err(), "truncated header");
        let mut corrupt = file.clone();
        *corrupt.last_mut().unwrap() ^= 0xff;
        assert_eq!(decode(&key(), &corrupt), Err("checksum mismatch"));
        let mut other = key();
        other.shader_set_hash = 10;
        assert_eq!(decode(&other, &file), Err("kernels changed"));
        other = key();
        other.driver_version = 4;
        assert!(decode(&other, &file).is_err());
    }
}
