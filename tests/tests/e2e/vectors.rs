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

/// The committed vectors are the ones `chorus_tests::vectors::all()` builds today, byte for
/// byte. With `CHORUS_WRITE_VECTORS=1 cargo test -p chorus-tests vectors` it rewrites them
/// instead (only needed when the envelope changes; the files are committed).
#[test]
fn the_committed_vectors_are_the_ones_the_generator_writes() {
    let write = std::env::var_os("CHORUS_WRITE_VECTORS").is_some();
    let dir = vectors_dir();
    let generated = chorus_tests::vectors::all();
    assert!(!generated.is_empty());
    for (name, env) in &generated {
        let json = codec::encode(env, Encoding::Json).expect("json");
        let value: serde_json::Value = serde_json::from_slice(&json).expect("json");
        let pretty = serde_json::to_string_pretty(&value).expect("pretty") + "\n";
        let mp = hex::encode(codec::encode(env, Encoding::MsgPack).expect("msgpack")) + "\n";
        let json_path = dir.join(format!("{name}.json"));
        let hex_path = dir.join(format!("{name}.msgpack.hex"));
        if write {
            std::fs::write(&json_path, &pretty).expect("write");
            std::fs::write(&hex_path, &mp).expect("write");
        } else {
            assert_eq!(
                std::fs::read_to_string(&json_path).expect("committed json vector"),
                pretty,
                "{name}.json differs from the generator (CHORUS_WRITE_VECTORS=1 rewrites it)"
            );
            assert_eq!(
                std::fs::read_to_string(&hex_path).expect("committed hex vector"),
                mp,
                "{name}.msgpack.hex differs from the generator"
            );
        }
    }
    let mut generated_names: Vec<String> = generated.iter().map(|(n, _)| n.to_string()).collect();
    generated_names.sort();
    assert_eq!(
        names(),
        generated_names,
        "every committed vector is generated"
    );
}
