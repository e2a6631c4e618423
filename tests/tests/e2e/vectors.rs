//! Byte-level test vectors (`tests/vectors/`): each envelope as MessagePack (hex) and as JSON.
//! Both must decode to the same envelope, and re-encoding must give back the same bytes, so a
//! client in another language can check itself against these files.

use std::path::{Path, PathBuf};

use agent_sdk::codec::{self, Encoding};

fn vectors_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("vectors")
}

fn names() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(vectors_dir())
        .expect("tests/vectors exists")
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            name.strip_suffix(".json").map(str::to_owned)
        })
        .collect();
    names.sort();
    names
}

#[test]
fn every_vector_decodes_the_same_from_both_encodings_and_re_encodes_byte_for_byte() {
    let names = names();
    assert!(
        names.len() >= 4,
        "expected at least 4 vectors, found {names:?}"
    );
    for name in names {
        let dir = vectors_dir();
        let json = std::fs::read(dir.join(format!("{name}.json"))).expect("json vector");
        let hex_text =
            std::fs::read_to_string(dir.join(format!("{name}.msgpack.hex"))).expect("hex vector");
        let msgpack = hex::decode(hex_text.trim()).expect("valid hex");

        let (from_json, enc) = codec::decode(&json).expect("json decodes");
        assert_eq!(enc, Encoding::Json);
        let (from_msgpack, enc) = codec::decode(&msgpack).expect("msgpack decodes");
        assert_eq!(enc, Encoding::MsgPack);
        assert_eq!(from_json, from_msgpack, "{name}: the two encodings differ");

        let re_msgpack = codec::encode(&from_msgpack, Encoding::MsgPack).expect("encode");
        assert_eq!(
            hex::encode(&re_msgpack),
            hex_text.trim(),
            "{name}: msgpack bytes"
        );
        let re_json: serde_json::Value =
            serde_json::from_slice(&codec::encode(&from_json, Encoding::Json).expect("encode"))
                .expect("json");
        let original: serde_json::Value = serde_json::from_slice(&json).expect("json");
        assert_eq!(re_json, original, "{name}: json");
    }
}

/// Regenerates the vectors: `CHORUS_WRITE_VECTORS=1 cargo test -p chorus-tests vectors`.
/// Only needed when the envelope changes; the files are committed.
#[test]
fn write_vectors_when_asked() {
    if std::env::var_os("CHORUS_WRITE_VECTORS").is_none() {
        return;
    }
    for (name, env) in chorus_tests::vectors::all() {
        let dir = vectors_dir();
        let json = codec::encode(&env, Encoding::Json).expect("json");
        let value: serde_json::Value = serde_json::from_slice(&json).expect("json");
        let pretty = serde_json::to_string_pretty(&value).expect("pretty");
        std::fs::write(dir.join(format!("{name}.json")), pretty + "\n").expect("write");
        let mp = codec::encode(&env, Encoding::MsgPack).expect("msgpack");
        std::fs::write(
            dir.join(format!("{name}.msgpack.hex")),
            hex::encode(mp) + "\n",
        )
        .expect("write");
    }
}
