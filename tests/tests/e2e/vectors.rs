//! Byte-level test vectors (`tests/vectors/`): each envelope as MessagePack (hex), as readable
//! JSON, and as the exact JSON bytes the SDK writes (`tests/vectors/json/`). All three must
//! decode to the same envelope, and re-encoding must give back the same bytes, so a client in
//! another language can check itself against these files.

use std::path::{Path, PathBuf};

use chorus_sdk::codec::{self, Encoding};

fn vectors_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("vectors")
}

/// The second set: each envelope exactly as the JSON encoder writes it (compact, fields in the
/// order of docs/PROTOCOL.md section 4), with no trailing newline.
fn json_wire_dir() -> PathBuf {
    vectors_dir().join("json")
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
        let re_json_bytes = codec::encode(&from_json, Encoding::Json).expect("encode");
        let re_json: serde_json::Value = serde_json::from_slice(&re_json_bytes).expect("json");
        let original: serde_json::Value = serde_json::from_slice(&json).expect("json");
        assert_eq!(re_json, original, "{name}: json");

        let wire =
            std::fs::read(json_wire_dir().join(format!("{name}.json"))).expect("json wire vector");
        let (from_wire, enc) = codec::decode(&wire).expect("json wire vector decodes");
        assert_eq!(enc, Encoding::Json);
        assert_eq!(
            from_wire, from_msgpack,
            "{name}: the json wire vector differs"
        );
        assert_eq!(
            String::from_utf8_lossy(&re_json_bytes),
            String::from_utf8_lossy(&wire),
            "{name}: json wire bytes"
        );

        // The compact form (protocol 2): with what its subject carries restored, the same
        // envelope; re-encoded for that subject, the same bytes.
        let compact_text = std::fs::read_to_string(dir.join(format!("{name}.compact.hex")))
            .expect("compact vector");
        let compact = hex::decode(compact_text.trim()).expect("valid hex");
        let (mut from_compact, enc) = codec::decode(&compact).expect("compact decodes");
        assert_eq!(enc, Encoding::Compact);
        let subjects = chorus_sdk::Subjects::default();
        let subject = chorus_tests::vectors::subject(&name);
        let implied = subjects.implied(&subject);
        implied.restore(&mut from_compact);
        assert_eq!(
            from_compact, from_msgpack,
            "{name}: the compact form differs"
        );
        let re_compact =
            codec::encode_on(&from_compact, Encoding::Compact, &implied).expect("encode");
        assert_eq!(
            hex::encode(&re_compact),
            compact_text.trim(),
            "{name}: compact bytes"
        );
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
        let wire = String::from_utf8(json.to_vec()).expect("json is utf-8");
        let subjects = chorus_sdk::Subjects::default();
        let subject = chorus_tests::vectors::subject(name);
        let implied = subjects.implied(&subject);
        let compact =
            hex::encode(codec::encode_on(env, Encoding::Compact, &implied).expect("compact"))
                + "\n";
        let compact_path = dir.join(format!("{name}.compact.hex"));
        let json_path = dir.join(format!("{name}.json"));
        let hex_path = dir.join(format!("{name}.msgpack.hex"));
        let wire_path = json_wire_dir().join(format!("{name}.json"));
        if write {
            std::fs::create_dir_all(json_wire_dir()).expect("mkdir");
            std::fs::write(&json_path, &pretty).expect("write");
            std::fs::write(&hex_path, &mp).expect("write");
            std::fs::write(&wire_path, &wire).expect("write");
            std::fs::write(&compact_path, &compact).expect("write");
        } else {
            assert_eq!(
                std::fs::read_to_string(&compact_path).expect("committed compact vector"),
                compact,
                "{name}.compact.hex differs from the generator"
            );
            assert_eq!(
                std::fs::read_to_string(&wire_path).expect("committed json wire vector"),
                wire,
                "json/{name}.json differs from the generator"
            );
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
    let mut wire_names: Vec<String> = std::fs::read_dir(json_wire_dir())
        .expect("tests/vectors/json exists")
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            name.strip_suffix(".json").map(str::to_owned)
        })
        .collect();
    wire_names.sort();
    assert_eq!(
        wire_names, generated_names,
        "every json wire vector is generated"
    );
}

fn protocol_doc() -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/PROTOCOL.md"))
        .expect("docs/PROTOCOL.md")
}

/// The rows of the first table after the line `marker` in docs/PROTOCOL.md: each row's first
/// column (a backticked name) and its other columns.
fn doc_table(doc: &str, marker: &str) -> Vec<(String, Vec<String>)> {
    let start = doc
        .lines()
        .position(|l| l.trim() == marker)
        .unwrap_or_else(|| panic!("docs/PROTOCOL.md has no line {marker:?}"));
    let rows: Vec<(String, Vec<String>)> = doc
        .lines()
        .skip(start + 1)
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'))
        .filter_map(|l| {
            let cells: Vec<String> = l
                .trim_matches('|')
                .split('|')
                .map(|c| c.trim().to_owned())
                .collect();
            let name = cells.first()?.strip_prefix('`')?.strip_suffix('`')?;
            Some((name.to_owned(), cells[1..].to_vec()))
        })
        .collect();
    assert!(!rows.is_empty(), "no table after {marker:?}");
    rows
}

fn json_wire(name: &str) -> serde_json::Map<String, serde_json::Value> {
    let bytes = std::fs::read(json_wire_dir().join(format!("{name}.json"))).expect("wire vector");
    match serde_json::from_slice(&bytes).expect("json") {
        serde_json::Value::Object(map) => map,
        other => panic!("{name}: not an object: {other}"),
    }
}

fn keys(map: &serde_json::Map<String, serde_json::Value>) -> Vec<String> {
    let mut keys: Vec<String> = map.keys().cloned().collect();
    keys.sort();
    keys
}

fn names_of(rows: &[(String, Vec<String>)]) -> Vec<String> {
    let mut names: Vec<String> = rows.iter().map(|(n, _)| n.clone()).collect();
    names.sort();
    names
}

/// Section 4's table lists exactly the envelope's fields, the vector `06-every-field` writes
/// every one of them (and every member of every nested structure, with the nested tables of
/// section 4.1), and every field the table says is always written is in every vector.
#[test]
fn the_every_field_vector_sets_every_field_the_spec_lists() {
    let doc = protocol_doc();
    let fields = doc_table(&doc, "<!-- envelope-fields -->");
    let every = json_wire(chorus_tests::vectors::EVERY_FIELD);
    assert_eq!(
        keys(&every),
        names_of(&fields),
        "the §4 table and the every-field vector"
    );
    // The order of the table is the order the SDK writes.
    let order: Vec<String> = fields.iter().map(|(n, _)| n.clone()).collect();
    let wire_order: Vec<String> = {
        let bytes = std::fs::read(
            json_wire_dir().join(format!("{}.json", chorus_tests::vectors::EVERY_FIELD)),
        )
        .expect("wire");
        let text = String::from_utf8(bytes).expect("utf-8");
        let mut at: Vec<(usize, String)> = order
            .iter()
            .map(|n| (text.find(&format!("\"{n}\":")).expect("key"), n.clone()))
            .collect();
        at.sort();
        at.into_iter().map(|(_, n)| n).collect()
    };
    assert_eq!(wire_order, order, "fields are written in table order");

    for (nested, path) in [
        ("seq", vec!["seq"]),
        ("expect", vec!["expect"]),
        ("progress", vec!["progress"]),
        ("trace", vec!["trace"]),
        ("signature", vec!["signature"]),
        ("encryption", vec!["encryption"]),
    ] {
        let rows = doc_table(&doc, &format!("<!-- nested: {nested} -->"));
        let value = path
            .iter()
            .fold(serde_json::Value::Object(every.clone()), |v, k| {
                v[*k].clone()
            });
        let map = value.as_object().expect("an object").clone();
        assert_eq!(keys(&map), names_of(&rows), "{nested}");
    }
    let recipient = every["encryption"]["recipients"][0]
        .as_object()
        .expect("a recipient")
        .clone();
    assert_eq!(
        keys(&recipient),
        names_of(&doc_table(&doc, "<!-- nested: recipient -->")),
        "encryption.recipients[]"
    );

    // "always" in the written column: in every vector, whatever else it sets.
    let always: Vec<&String> = fields
        .iter()
        .filter(|(_, cells)| cells.iter().any(|c| c == "always"))
        .map(|(n, _)| n)
        .collect();
    assert!(always.iter().any(|n| *n == "content_type"), "{always:?}");
    for (name, _) in chorus_tests::vectors::all() {
        let map = json_wire(name);
        for field in &always {
            assert!(map.contains_key(*field), "{name} lacks {field}");
        }
        for key in map.keys() {
            assert!(
                fields.iter().any(|(n, _)| n == key),
                "{name}: {key} is not in the table"
            );
        }
    }
}

/// `progress.fraction` is a 32-bit float in MessagePack (`0xca`), a number in JSON.
#[test]
fn progress_fraction_is_a_32_bit_float() {
    let hex_text = std::fs::read_to_string(vectors_dir().join(format!(
        "{}.msgpack.hex",
        chorus_tests::vectors::EVERY_FIELD
    )))
    .expect("hex");
    let key = hex::encode([&[0xa8][..], b"fraction", &[0xca]].concat());
    assert!(hex_text.contains(&key), "fraction as float 32: {key}");
    assert!(hex_text.contains(&(key + &hex::encode(0.25f32.to_be_bytes()))));
    let every = json_wire(chorus_tests::vectors::EVERY_FIELD);
    assert_eq!(every["progress"]["fraction"], serde_json::json!(0.25));
}

/// The algorithm names in the vectors and the spec are the ones the SDK checks.
#[test]
fn the_algorithm_names_are_the_sdks() {
    let doc = protocol_doc();
    assert!(doc.contains(chorus_sdk::encryption::ENCRYPTION_ALG));
    assert!(!doc.contains("hpke-x25519-aes256gcm"));
    for (name, env) in chorus_tests::vectors::all() {
        if let Some(enc) = &env.encryption {
            assert_eq!(enc.alg, chorus_sdk::encryption::ENCRYPTION_ALG, "{name}");
            assert_eq!(
                env.content_type,
                chorus_sdk::encryption::CONTENT_TYPE_ENCRYPTED,
                "{name}"
            );
        }
        if let Some(sig) = &env.signature {
            assert_eq!(sig.alg, chorus_sdk::security::SIGNATURE_ALG, "{name}");
        }
    }
}

/// Every cut-short vector is refused as malformed (5006), never read as another version, and
/// never a panic; `"version": "1"` reads as 1.0, and `"2"` is an unknown major.
#[test]
fn truncated_vectors_are_malformed_and_a_bare_major_is_a_version() {
    for (name, env) in chorus_tests::vectors::all() {
        for encoding in [Encoding::MsgPack, Encoding::Json] {
            let bytes = codec::encode(&env, encoding).expect("encode");
            for n in 0..bytes.len() {
                match codec::decode(&bytes[..n]) {
                    Err(codec::CodecError::Malformed(_)) => {}
                    Err(codec::CodecError::UnknownEncoding) if n == 0 => {}
                    other => panic!("{name} {encoding:?} cut at {n}: {other:?}"),
                }
            }
        }
        let mut value: serde_json::Value =
            serde_json::from_slice(&codec::encode(&env, Encoding::Json).expect("json"))
                .expect("json");
        value["version"] = "1".into();
        let (read, _) =
            codec::decode(&serde_json::to_vec(&value).expect("json")).expect("\"1\" is 1.0");
        assert_eq!(read, env, "{name}");
        value["version"] = "2".into();
        assert!(matches!(
            codec::decode(&serde_json::to_vec(&value).expect("json")),
            Err(codec::CodecError::UnsupportedVersion { .. })
        ));
        for malformed in ["1.0.0", "1."] {
            value["version"] = malformed.into();
            assert!(
                matches!(
                    codec::decode(&serde_json::to_vec(&value).expect("json")),
                    Err(codec::CodecError::Malformed(_))
                ),
                "{malformed}"
            );
        }
        value["version"] = 1.into();
        assert!(matches!(
            codec::decode(&serde_json::to_vec(&value).expect("json")),
            Err(codec::CodecError::Malformed(_))
        ));
        // The raw string is compared: "v1" is reported as a version this side does not speak.
        value["version"] = "v1".into();
        assert!(matches!(
            codec::decode(&serde_json::to_vec(&value).expect("json")),
            Err(codec::CodecError::UnsupportedVersion { .. })
        ));
    }
}

/// Vector 01 is what the demo calculator (`chorus up`) serves: its command and argument type;
/// vector 02 is its answer.
#[test]
fn the_request_vector_is_the_demo_calculators_own() {
    let all = chorus_tests::vectors::all();
    let (_, request) = &all[0];
    assert_eq!(request.name.as_deref(), Some("calculation"));
    assert_eq!(request.to, ["calculator"]);
    let calc: chorus_demo::Calculation =
        codec::decode_payload(&request.payload, &request.content_type).expect("a Calculation");
    assert_eq!(calc.operation, "add");
    assert_eq!(calc.operands, [2.0, 3.0]);
    let (_, response) = &all[1];
    let result: f64 =
        codec::decode_payload(&response.payload, &response.content_type).expect("an f64");
    assert_eq!(result, 5.0);
}

/// The JSON details section 3.2 gives for byte-exact output: float 32 in shortest form (not
/// finite: `null`, read back as absent), which characters a string escapes, and that a
/// MessagePack `float 64` fraction and signed integers are read too.
#[test]
fn json_numbers_and_strings_are_written_as_documented() {
    use chorus_sdk::envelope::{Progress, TaskState};
    let (_, mut env) = chorus_tests::vectors::all().remove(0);
    env.reason = Some("a\"b\\c\u{1}\n/é".into());
    for (fraction, text) in [
        (0.25f32, "0.25"),
        (0.0, "0.0"),
        (1e-7, "1e-7"),
        (0.1, "0.1"),
        (f32::NAN, "null"),
    ] {
        env.progress = Some(Progress {
            state: TaskState::Running,
            fraction: Some(fraction),
        });
        let json = codec::encode(&env, Encoding::Json).expect("json");
        let text_out = String::from_utf8(json.to_vec()).expect("utf-8");
        assert!(
            text_out.contains(&format!("\"fraction\":{text}}}")),
            "{text_out}"
        );
        assert!(
            text_out.contains(r#""reason":"a\"b\\c\u0001\n/é""#),
            "{text_out}"
        );
        let (back, _) = codec::decode(&json).expect("decodes");
        let read = back.progress.expect("progress").fraction;
        if fraction.is_nan() {
            assert_eq!(read, None);
        } else {
            assert_eq!(read, Some(fraction));
        }
    }
    // `float 64` for the fraction and `int 8` for hops are accepted from MessagePack.
    let mut value: serde_json::Value =
        serde_json::from_slice(&codec::encode(&env, Encoding::Json).expect("json")).expect("v");
    value["progress"]["fraction"] = serde_json::json!(0.5f64);
    value["hops"] = serde_json::json!(3i64);
    let (from_json, _) = codec::decode(&serde_json::to_vec(&value).expect("json")).expect("json");
    let mut mp = codec::encode(&from_json, Encoding::MsgPack)
        .expect("mp")
        .to_vec();
    let f32_half = [&[0xca][..], &0.5f32.to_be_bytes()].concat();
    let at = mp.windows(5).position(|w| w == f32_half).expect("fraction");
    mp.splice(at..at + 5, [&[0xcb][..], &0.5f64.to_be_bytes()].concat());
    let hops = [&[0xa4][..], b"hops", &[0x03]].concat();
    let at = mp.windows(6).position(|w| w == hops).expect("hops") + 5;
    mp.splice(at..at + 1, [0xd0, 0x03]);
    let (from_mp, _) = codec::decode(&mp).expect("float 64 and int 8 are read");
    assert_eq!(from_mp, from_json);
    assert_eq!(from_mp.hops, 3);
}

/// `null` reads as absent for the fields whose default is "none", and is malformed for the
/// others (section 4).
#[test]
fn null_is_absent_only_where_the_default_is_none() {
    let every = json_wire(chorus_tests::vectors::EVERY_FIELD);
    let fields = doc_table(&protocol_doc(), "<!-- envelope-fields -->");
    for (name, cells) in &fields {
        let default = &cells[3];
        let mut value = every.clone();
        value.insert(name.clone(), serde_json::Value::Null);
        let decoded = codec::decode(&serde_json::to_vec(&value).expect("json"));
        if default.starts_with("none") || name == "correlation_id" {
            assert!(decoded.is_ok(), "{name}: {decoded:?}");
        } else {
            assert!(
                matches!(decoded, Err(codec::CodecError::Malformed(_))),
                "{name}: {decoded:?}"
            );
        }
    }
}

/// The demo calculator (`chorus up`) answers vector 01, sent as it is (with a fresh id and
/// time, so it has not expired) in either encoding, with the reply vector 02 shows.
#[tokio::test]
async fn the_demo_calculator_answers_the_request_vector() {
    use chorus_tests::{WAIT, within};
    let server = chorus_tests::server();
    let coordinator = chorus_tests::coordinator(&server, false).await;
    let quiet: fn(&str) = |_| {};
    let demo = within(
        WAIT,
        "demo start",
        chorus_demo::Demo::start(server.url(), quiet),
    )
    .await
    .expect("demo agents start");
    let raw = chorus_tests::raw_broker(&server).await;
    let (_, mut request) = chorus_tests::vectors::all().remove(0);
    let (_, expected) = chorus_tests::vectors::all().remove(1);
    let subject = chorus_sdk::Subjects::new("chorus")
        .expect("root")
        .command("calculator", "calculation")
        .expect("subject");
    for encoding in [Encoding::MsgPack, Encoding::Json] {
        request.id = uuid::Uuid::now_v7();
        request.timestamp_ms = chorus_sdk::envelope::now_ms();
        let bytes = codec::encode(&request, encoding).expect("encode");
        let msg = within(WAIT, "reply", raw.request(&subject, None, bytes, WAIT))
            .await
            .expect("a reply");
        let (reply, reply_encoding) = codec::decode(msg.payload()).expect("an envelope");
        assert_eq!(reply_encoding, encoding);
        assert_eq!(
            (reply.kind, reply.performative, reply.status),
            (expected.kind, expected.performative, expected.status)
        );
        assert_eq!(reply.from, expected.from);
        assert_eq!(reply.to, expected.to);
        assert_eq!(reply.name, expected.name);
        assert_eq!(reply.in_reply_to, Some(request.id));
        assert_eq!(reply.correlation_id, Some(request.id));
        let result: f64 =
            codec::decode_payload(&reply.payload, &reply.content_type).expect("an f64");
        assert_eq!(result, 5.0);
    }
    within(WAIT, "demo shutdown", demo.shutdown()).await;
    coordinator.shutdown().await;
}

/// Section 3.5's key table is what the compact encoder writes (the every-field vector in the
/// compact form has every listed key but the conditional ones: the timestamp, which its
/// UUIDv7 id carries, the textual traceparent and the minor version), and the codes it gives
/// the closed vocabularies are the SDK's.
#[test]
fn the_compact_key_table_and_the_codes_match_the_sdk() {
    use chorus_sdk::envelope::TaskState;
    use chorus_sdk::{DeliveryClass, Kind, Performative, Priority};
    use std::collections::BTreeSet;
    let doc = protocol_doc();
    let documented: BTreeSet<u64> = doc_table(&doc, "<!-- compact-keys -->")
        .iter()
        .map(|(k, _)| k.parse().expect("a numeric key"))
        .collect();
    let hex_text = std::fs::read_to_string(vectors_dir().join(format!(
        "{}.compact.hex",
        chorus_tests::vectors::EVERY_FIELD
    )))
    .expect("compact vector");
    let bytes = hex::decode(hex_text.trim()).expect("hex");
    let written: std::collections::BTreeMap<u64, serde::de::IgnoredAny> =
        rmp_serde::from_slice(&bytes).expect("a map with integer keys");
    let written: BTreeSet<u64> = written.keys().copied().collect();
    let conditional: BTreeSet<u64> = [5, 25, 34].into();
    assert_eq!(
        written,
        documented.difference(&conditional).copied().collect(),
        "the keys of section 3.5 and the every-field vector's compact form"
    );
    // Codes count from 1 in the order of section 5's tables (and the lists of section 3.5).
    let kinds: Vec<String> = doc_table(&doc, "### 5.1 Kinds")
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(
        kinds,
        Kind::ALL
            .iter()
            .map(|k| k.as_str().to_owned())
            .collect::<Vec<_>>()
    );
    let performatives: Vec<String> = doc_table(&doc, "### 5.2 Performatives")
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(
        performatives,
        Performative::ALL
            .iter()
            .map(|p| p.as_str().to_owned())
            .collect::<Vec<_>>()
    );
    for (i, k) in Kind::ALL.iter().enumerate() {
        assert_eq!(usize::from(k.code()), i + 1);
    }
    let listed = |values: Vec<(&str, u8)>| {
        values
            .iter()
            .map(|(v, c)| format!("`{v}` = {c}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let prose = doc.split_whitespace().collect::<Vec<_>>().join(" ");
    for line in [
        listed(
            Priority::ALL
                .iter()
                .map(|p| (p.as_str(), p.code()))
                .collect(),
        ),
        listed(
            DeliveryClass::ALL
                .iter()
                .map(|d| (d.as_str(), d.code()))
                .collect(),
        ),
        listed(
            TaskState::ALL
                .iter()
                .map(|s| (s.as_str(), s.code()))
                .collect(),
        ),
    ] {
        assert!(prose.contains(&line), "section 3.5 lists {line}");
    }
}

/// The task vectors read as the messages of one task: each on its kind's subject, with the
/// state, progress, chunk number and text a watcher sees.
#[test]
fn the_task_vectors_read_as_one_tasks_messages() {
    use chorus_sdk::task::TaskMessage;
    use chorus_sdk::{TaskState, TaskUpdate};
    let subjects = chorus_sdk::Subjects::default();
    let task = chorus_tests::vectors::task_id();
    let dir = vectors_dir();
    let read = |name: &str| {
        let hex_text = std::fs::read_to_string(dir.join(format!("{name}.compact.hex")))
            .expect("committed compact vector");
        let bytes = hex::decode(hex_text.trim()).expect("hex");
        let (envelope, _) = codec::decode(&bytes).expect("decodes");
        let subject = chorus_tests::vectors::subject(name);
        let (id, kind) = subjects.task_of(&subject).expect("a task subject");
        assert_eq!(id, task, "{name}");
        assert_eq!(envelope.correlation_id, Some(task), "{name}");
        TaskUpdate {
            seq: 1,
            stored_ms: 0,
            kind,
            envelope,
        }
    };
    let submitted = read("07-task-submitted");
    assert_eq!(submitted.state(), Some(TaskState::Submitted));
    assert_eq!(
        submitted.envelope.id, task,
        "a task's id is its submission's"
    );
    assert_eq!(submitted.payload_as::<String>().expect("input"), "agents");
    let progress = read("08-task-progress");
    assert_eq!(progress.kind, TaskMessage::Progress);
    assert_eq!(progress.fraction(), Some(0.25));
    assert_eq!(progress.text(), Some("writing"));
    let chunk = read("09-task-chunk");
    assert_eq!(chunk.chunk(), Some(1));
    assert!(!chunk.is_last_chunk());
    let completed = read("10-task-completed");
    assert_eq!(completed.state(), Some(TaskState::Completed));
    assert_eq!(completed.payload_as::<u32>().expect("result"), 14);
    let cancel = read("11-task-cancel");
    assert_eq!(cancel.kind, TaskMessage::Cancel);
    assert_eq!(cancel.state(), None);
}

/// The contract-net vectors read as one round: a call, a proposal that decodes as the SDK's,
/// and an outcome that names the round.
#[test]
fn the_negotiation_vectors_read_as_one_round() {
    use chorus_sdk::negotiate::Proposal;
    use chorus_sdk::{Kind, Performative};
    let dir = vectors_dir();
    let read = |name: &str| {
        let text = std::fs::read_to_string(dir.join(format!("{name}.msgpack.hex")))
            .expect("committed vector");
        codec::decode(&hex::decode(text.trim()).expect("hex"))
            .expect("decodes")
            .0
    };
    let call = read("12-negotiate-call");
    assert_eq!(
        (call.kind, call.performative),
        (Kind::Request, Performative::Negotiate)
    );
    let round = call.correlation_id.expect("the round");
    let proposal = read("13-negotiate-proposal");
    assert_eq!(proposal.in_reply_to, Some(call.id));
    assert_eq!(proposal.correlation_id, Some(round));
    let offer: Proposal =
        chorus_sdk::codec::decode_payload(&proposal.payload, &proposal.content_type)
            .expect("a proposal");
    assert_eq!(offer, Proposal::at(5.0).eta_ms(120).confidence(0.95));
    let lost = read("14-negotiate-lost");
    assert_eq!(lost.performative, Performative::Refuse);
    assert_eq!(lost.correlation_id, Some(round));
}

/// Issue 32, item 18: the decoding cases (`tests/vectors/decode/`): bytes no encoder writes,
/// each either read (`NAME.json`: the envelope, as the SDK writes it in JSON) or refused with
/// 5006 and its own reason (`NAME.error`), as the generator and the SDK say today; with
/// `CHORUS_WRITE_VECTORS=1` they are rewritten. The reasons are docs/PROTOCOL.md's.
#[test]
fn the_decoding_cases_are_read_or_refused_as_committed() {
    let write = std::env::var_os("CHORUS_WRITE_VECTORS").is_some();
    let dir = vectors_dir().join("decode");
    let subjects = chorus_sdk::Subjects::default();
    let doc = protocol_doc();
    let cases = chorus_tests::vectors::decode_cases();
    assert!(cases.len() >= 15);
    let mut reasons = std::collections::BTreeSet::new();
    for case in &cases {
        let implied = subjects.implied(case.subject);
        let hex_text = hex::encode(&case.bytes) + "\n";
        let (file, outcome) = match codec::decode_on(&case.bytes, &implied) {
            Ok((env, encoding)) => {
                assert_eq!(encoding, Encoding::Compact, "{}", case.name);
                let json = codec::encode(&env, Encoding::Json).expect("json");
                (
                    format!("{}.json", case.name),
                    String::from_utf8(json.to_vec()).expect("utf-8") + "\n",
                )
            }
            Err(err) => {
                // Every codec error is answered with 5006 (section 3.1).
                let reason = err.to_string();
                assert!(
                    reasons.insert(reason.clone()),
                    "{} repeats {reason:?}",
                    case.name
                );
                assert!(
                    write || doc.contains(&format!("`{reason}`")),
                    "docs/PROTOCOL.md does not give the reason {reason:?} ({})",
                    case.name
                );
                (format!("{}.error", case.name), reason + "\n")
            }
        };
        if write {
            std::fs::create_dir_all(&dir).expect("mkdir");
            std::fs::write(dir.join(format!("{}.hex", case.name)), &hex_text).expect("write");
            std::fs::write(dir.join(&file), &outcome).expect("write");
        } else {
            let read = |f: &str| {
                std::fs::read_to_string(dir.join(f))
                    .unwrap_or_else(|e| panic!("tests/vectors/decode/{f}: {e}"))
            };
            assert_eq!(
                read(&format!("{}.hex", case.name)),
                hex_text,
                "{}",
                case.name
            );
            assert_eq!(read(&file), outcome, "{}", case.name);
        }
    }
    // Nothing committed that the generator does not make.
    let mut committed: Vec<String> = std::fs::read_dir(&dir)
        .expect("tests/vectors/decode")
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    committed.sort();
    assert_eq!(committed.len(), cases.len() * 2, "{committed:?}");
}

/// docs/PROTOCOL.md section 3.2's rule for a `float 32` in JSON, applied to the shortest
/// digits, is what the SDK writes: over 200,000 values across the whole range.
#[test]
fn the_json_float_rule_is_what_the_sdk_writes() {
    fn by_rule(x: f32) -> String {
        if x == 0.0 {
            return if x.is_sign_negative() { "-0.0" } else { "0.0" }.into();
        }
        let sign = if x < 0.0 { "-" } else { "" };
        // The fewest digits that read back, rounded from the exact value (ties to even).
        let sci = (1..=9)
            .map(|digits| format!("{:.*e}", digits - 1, f64::from(x.abs())))
            .find(|t| t.parse::<f32>().ok() == Some(x.abs()))
            .expect("9 digits always read back");
        let (mantissa, exp) = sci.split_once('e').expect("exponent form");
        let d: String = mantissa.chars().filter(|c| *c != '.').collect();
        let d = d.trim_end_matches('0').to_owned();
        let d = if d.is_empty() { "0".to_owned() } else { d };
        let n = d.len() as i32;
        let p = exp.parse::<i32>().expect("exponent") + 1;
        let text = if n <= p && p <= 13 {
            format!("{d}{}.0", "0".repeat((p - n) as usize))
        } else if 0 < p && p < n && p <= 13 {
            format!("{}.{}", &d[..p as usize], &d[p as usize..])
        } else if -6 < p && p <= 0 {
            format!("0.{}{d}", "0".repeat((-p) as usize))
        } else if n == 1 {
            format!("{d}e{:+}", p - 1)
        } else {
            format!("{}.{}e{:+}", &d[..1], &d[1..], p - 1)
        };
        format!("{sign}{text}")
    }
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut checked = 0;
    for i in 0..200_000u32 {
        let x = match i % 4 {
            // Every bit pattern, so every exponent.
            0 | 1 => f32::from_bits(next() as u32),
            // Fractions, the envelope's own floats.
            2 => (next() % 1_000_001) as f32 / 1_000_000.0,
            _ => (next() % 100_000) as f32 / 10f32.powi((next() % 12) as i32),
        };
        if !x.is_finite() {
            continue;
        }
        assert_eq!(
            serde_json::to_string(&x).expect("json"),
            by_rule(x),
            "{x:e}"
        );
        checked += 1;
    }
    assert!(checked > 190_000);

    // A sample for other implementations (`tests/vectors/floats.txt`: the value's bits in hex,
    // then its JSON text), which the Python SDK's tests read.
    let mut sample = String::new();
    for i in 0..2_000u32 {
        let x = match i % 2 {
            0 => f32::from_bits(next() as u32),
            _ => (next() % 1_000_001) as f32 / 1_000_000.0,
        };
        if x.is_finite() {
            let text = serde_json::to_string(&x).expect("json");
            sample.push_str(&format!("{:08x} {text}\n", x.to_bits()));
        }
    }
    let path = vectors_dir().join("floats.txt");
    if std::env::var_os("CHORUS_WRITE_VECTORS").is_some() {
        std::fs::write(&path, &sample).expect("write");
    } else {
        assert_eq!(
            std::fs::read_to_string(&path).expect("tests/vectors/floats.txt"),
            sample,
            "CHORUS_WRITE_VECTORS=1 rewrites it"
        );
    }
}
