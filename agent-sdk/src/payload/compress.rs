//! zstd compression of payloads, with the reader's size limit enforced while decompressing.

use bytes::Bytes;

use crate::protocol::status::StatusCode;

/// The compression level: zstd's default, fast on both sides.
const LEVEL: i32 = 3;

/// `payload` compressed, if that saves at least a tenth of it.
pub fn compress(payload: &[u8]) -> Option<Bytes> {
    let packed = zstd::bulk::compress(payload, LEVEL).ok()?;
    (packed.len() <= payload.len() - payload.len() / 10).then(|| Bytes::from(packed))
}

/// `payload` decompressed, refused (5006) when it does not decompress or would be larger
/// than `limit` bytes.
///
/// # Errors
/// 5006 (data format) with a reason when `payload` is not a zstd frame, does not decompress, or
/// would be larger than `limit`.
pub fn decompress(payload: &[u8], limit: usize) -> Result<Bytes, (StatusCode, String)> {
    let refuse = |why: String| (StatusCode::DATA_FORMAT, why);
    // The frame says its size: a payload claiming more than the limit is refused before any
    // memory is taken for it. One that does not say is read up to the limit.
    let size = match zstd::zstd_safe::get_frame_content_size(payload) {
        Ok(Some(size)) => usize::try_from(size).unwrap_or(usize::MAX),
        Ok(None) => limit,
        Err(_) => return Err(refuse("the payload is not a zstd frame".into())),
    };
    if size > limit {
        return Err(refuse(format!(
            "the payload decompresses to {size} bytes, over the limit of {limit}"
        )));
    }
    zstd::bulk::decompress(payload, size)
        .map(Bytes::from)
        .map_err(|e| refuse(format!("the payload does not decompress: {e}")))
}

/// Decompresses `env`'s payload if it came with a content encoding, leaving none: 5006 for an
/// encoding this SDK does not read, or a payload that does not decompress within `limit`.
///
/// # Errors
/// 5006 (data format) with a reason when the encoding is not zstd, or the payload does not
/// decompress within `limit`.
pub fn open_encoding(
    env: &mut crate::protocol::envelope::Envelope,
    limit: usize,
) -> Result<(), (StatusCode, String)> {
    let Some(encoding) = env.content_encoding.as_deref() else {
        return Ok(());
    };
    if encoding != super::ZSTD {
        return Err((
            StatusCode::DATA_FORMAT,
            format!("unsupported content encoding {encoding:?}"),
        ));
    }
    env.payload = decompress(&env.payload, limit)?;
    env.content_encoding = None;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_compressible_payload_round_trips_and_shrinks() {
        let text = "the quick brown fox jumps over the lazy dog ".repeat(12_000);
        let packed = compress(text.as_bytes()).expect("compresses");
        assert!(packed.len() < text.len() / 10, "{} bytes", packed.len());
        let back = decompress(&packed, text.len()).expect("decompresses");
        assert_eq!(&back[..], text.as_bytes());
    }

    #[test]
    fn random_bytes_are_left_as_they_are() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let noise: Vec<u8> = (0..65_536)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 24) as u8
            })
            .collect();
        assert!(compress(&noise).is_none());
    }

    #[test]
    fn a_bomb_or_garbage_is_refused_with_5006() {
        let zeros = vec![0u8; 1 << 20];
        let packed = compress(&zeros).expect("compresses");
        let (status, why) = decompress(&packed, 1024).expect_err("over the limit");
        assert_eq!(status, StatusCode::DATA_FORMAT);
        assert!(why.contains("over the limit"), "{why}");
        let (status, _) = decompress(b"not zstd at all", 1024).expect_err("garbage");
        assert_eq!(status, StatusCode::DATA_FORMAT);
    }
}
