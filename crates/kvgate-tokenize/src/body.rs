//! A request body parsed once for tokenizing, its prompt borrowing its text from the
//! bytes it was read from.
//!
//! Owns the parse of a body into [`RequestBody`]: `messages` and `prompt` (a long
//! conversation's megabyte) become [`Json`], whose strings are slices of the body
//! wherever the JSON text has no escapes, and every other top-level field (options,
//! tools: small) a `serde_json` value as before. serde_json parses it all, so the
//! grammar, the numbers, the nesting limit and the error messages are serde_json's;
//! a duplicated key keeps its last value, as in a `serde_json::Map`. Must not
//! interpret fields (`request.rs` does).
//!
//! Why: parsing a 256k-token conversation into a `serde_json::Value` allocated, copied
//! and freed again a string per message, about a tenth of routing it
//! (docs/BENCHMARKS.md section 11, "Tokenization and the decision's cost").

use std::borrow::Cow;
use std::fmt;

use serde::de::{Deserialize, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};

/// A JSON value whose strings borrow from the text it was parsed from where they can.
#[derive(Clone, Debug, PartialEq)]
pub enum Json<'a> {
    Null,
    Bool(bool),
    Number(Number),
    String(Cow<'a, str>),
    Array(Vec<Json<'a>>),
    /// Members in the order written, duplicates included ([`Json::get`] finds the last).
    Object(Vec<(Cow<'a, str>, Json<'a>)>),
}

impl<'a> Json<'a> {
    /// The member `key` of an object (the last one written, as a `serde_json::Map`
    /// keeps); `None` for a missing key or a value that is not an object.
    pub fn get(&self, key: &str) -> Option<&Json<'a>> {
        match self {
            Json::Object(members) => members.iter().rev().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Json::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Json<'a>]> {
        match self {
            Json::Array(items) => Some(items),
            _ => None,
        }
    }

    pub fn is_null(&self) -> bool {
        matches!(self, Json::Null)
    }

    pub fn is_object(&self) -> bool {
        matches!(self, Json::Object(_))
    }

    /// The same value as a `serde_json::Value` (strings copied; members inserted in
    /// order, so a duplicated key keeps its first place and its last value, as when the
    /// text is parsed into a `Value`).
    pub fn to_value(&self) -> Value {
        match self {
            Json::Null => Value::Null,
            Json::Bool(b) => Value::Bool(*b),
            Json::Number(n) => Value::Number(n.clone()),
            Json::String(s) => Value::String(s.as_ref().to_owned()),
            Json::Array(items) => Value::Array(items.iter().map(Json::to_value).collect()),
            Json::Object(members) => Value::Object(
                members
                    .iter()
                    .map(|(k, v)| (k.as_ref().to_owned(), v.to_value()))
                    .collect(),
            ),
        }
    }
}

impl<'a> From<&'a Value> for Json<'a> {
    /// A view of a `serde_json::Value` (strings borrowed from it).
    fn from(v: &'a Value) -> Json<'a> {
        match v {
            Value::Null => Json::Null,
            Value::Bool(b) => Json::Bool(*b),
            Value::Number(n) => Json::Number(n.clone()),
            Value::String(s) => Json::String(Cow::Borrowed(s)),
            Value::Array(items) => Json::Array(items.iter().map(Json::from).collect()),
            Value::Object(members) => Json::Object(
                members
                    .iter()
                    .map(|(k, v)| (Cow::Borrowed(k.as_str()), Json::from(v)))
                    .collect(),
            ),
        }
    }
}

impl fmt::Display for Json<'_> {
    /// Compact JSON text, as `serde_json::Value` prints it (for error messages).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.to_value(), f)
    }
}

/// A string that borrows from the input when the deserializer lends it.
struct Text<'a>(Cow<'a, str>);

impl<'de> Deserialize<'de> for Text<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Text<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E>(self, s: &'de str) -> Result<Text<'de>, E> {
                Ok(Text(Cow::Borrowed(s)))
            }
            fn visit_str<E>(self, s: &str) -> Result<Text<'de>, E> {
                Ok(Text(Cow::Owned(s.to_owned())))
            }
            fn visit_string<E>(self, s: String) -> Result<Text<'de>, E> {
                Ok(Text(Cow::Owned(s)))
            }
        }
        d.deserialize_str(V)
    }
}

impl<'de> Deserialize<'de> for Json<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(JsonVisitor)
    }
}

struct JsonVisitor;

impl<'de> Visitor<'de> for JsonVisitor {
    type Value = Json<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any valid JSON value")
    }
    fn visit_bool<E>(self, b: bool) -> Result<Json<'de>, E> {
        Ok(Json::Bool(b))
    }
    fn visit_i64<E>(self, n: i64) -> Result<Json<'de>, E> {
        Ok(Json::Number(n.into()))
    }
    fn visit_u64<E>(self, n: u64) -> Result<Json<'de>, E> {
        Ok(Json::Number(n.into()))
    }
    fn visit_f64<E>(self, n: f64) -> Result<Json<'de>, E> {
        Ok(Number::from_f64(n).map_or(Json::Null, Json::Number))
    }
    fn visit_borrowed_str<E>(self, s: &'de str) -> Result<Json<'de>, E> {
        Ok(Json::String(Cow::Borrowed(s)))
    }
    fn visit_str<E>(self, s: &str) -> Result<Json<'de>, E> {
        Ok(Json::String(Cow::Owned(s.to_owned())))
    }
    fn visit_string<E>(self, s: String) -> Result<Json<'de>, E> {
        Ok(Json::String(Cow::Owned(s)))
    }
    fn visit_unit<E>(self) -> Result<Json<'de>, E> {
        Ok(Json::Null)
    }
    fn visit_none<E>(self) -> Result<Json<'de>, E> {
        Ok(Json::Null)
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Json<'de>, D::Error> {
        Json::deserialize(d)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Json<'de>, A::Error> {
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(4096));
        while let Some(item) = seq.next_element()? {
            items.push(item);
        }
        Ok(Json::Array(items))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Json<'de>, A::Error> {
        let mut members = Vec::new();
        while let Some((Text(key), value)) = map.next_entry()? {
            members.push((key, value));
        }
        Ok(Json::Object(members))
    }
}

/// An OpenAI request body, parsed once: the prompt (`messages`, `prompt`) as [`Json`]
/// borrowing from the body's bytes, every other top-level field as a `serde_json`
/// value. A body that is valid JSON but not an object parses too (routing rejects it
/// with its own message).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RequestBody<'a> {
    is_object: bool,
    /// The top-level fields other than `messages` and `prompt`.
    fields: Map<String, Value>,
    messages: Option<Json<'a>>,
    prompt: Option<Json<'a>>,
}

impl<'a> RequestBody<'a> {
    /// Parses a body's bytes (serde_json's grammar and errors).
    pub fn parse(bytes: &'a [u8]) -> Result<RequestBody<'a>, serde_json::Error> {
        serde_json::from_slice(bytes)
    }

    /// Whether the body is a JSON object.
    pub fn is_object(&self) -> bool {
        self.is_object
    }

    /// A top-level field as a `serde_json::Value` (a prompt's text copied).
    pub fn value_of(&self, key: &str) -> Option<Value> {
        match key {
            "messages" => self.messages.as_ref().map(Json::to_value),
            "prompt" => self.prompt.as_ref().map(Json::to_value),
            _ => self.fields.get(key).cloned(),
        }
    }

    /// The top-level fields other than `messages` and `prompt`.
    pub fn fields(&self) -> &Map<String, Value> {
        &self.fields
    }

    pub fn messages(&self) -> Option<&Json<'a>> {
        self.messages.as_ref()
    }

    pub fn prompt(&self) -> Option<&Json<'a>> {
        self.prompt.as_ref()
    }
}

impl<'a> From<&'a Value> for RequestBody<'a> {
    /// A body already parsed into a `serde_json::Value` (its prompt's strings borrowed).
    fn from(v: &'a Value) -> RequestBody<'a> {
        let Value::Object(members) = v else {
            return RequestBody::default();
        };
        let mut body = RequestBody {
            is_object: true,
            ..RequestBody::default()
        };
        for (key, value) in members {
            match key.as_str() {
                "messages" => body.messages = Some(Json::from(value)),
                "prompt" => body.prompt = Some(Json::from(value)),
                _ => {
                    body.fields.insert(key.clone(), value.clone());
                }
            }
        }
        body
    }
}

impl<'de> Deserialize<'de> for RequestBody<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(BodyVisitor)
    }
}

struct BodyVisitor;

impl<'de> Visitor<'de> for BodyVisitor {
    type Value = RequestBody<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any valid JSON value")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RequestBody<'de>, A::Error> {
        let mut body = RequestBody {
            is_object: true,
            ..RequestBody::default()
        };
        while let Some(Text(key)) = map.next_key()? {
            match key.as_ref() {
                "messages" => body.messages = Some(map.next_value()?),
                "prompt" => body.prompt = Some(map.next_value()?),
                _ => {
                    let value: Value = map.next_value()?;
                    body.fields.insert(key.into_owned(), value);
                }
            }
        }
        Ok(body)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<RequestBody<'de>, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(RequestBody::default())
    }
    fn visit_bool<E>(self, _: bool) -> Result<RequestBody<'de>, E> {
        Ok(RequestBody::default())
    }
    fn visit_i64<E>(self, _: i64) -> Result<RequestBody<'de>, E> {
        Ok(RequestBody::default())
    }
    fn visit_u64<E>(self, _: u64) -> Result<RequestBody<'de>, E> {
        Ok(RequestBody::default())
    }
    fn visit_f64<E>(self, _: f64) -> Result<RequestBody<'de>, E> {
        Ok(RequestBody::default())
    }
    fn visit_str<E>(self, _: &str) -> Result<RequestBody<'de>, E> {
        Ok(RequestBody::default())
    }
    fn visit_unit<E>(self) -> Result<RequestBody<'de>, E> {
        Ok(RequestBody::default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const TEXT: &str = r#"{"model": "m", "messages": [{"role": "user", "content": "plain"},
        {"role": "assistant", "content": "esc\"aped \u00e9", "n": [1, -2, 2.5, 1e300, null, true],
         "role": "user"}], "stream": true, "model": "last", "prompt": "p"}"#;

    #[test]
    fn parses_as_serde_json_does() {
        let body = RequestBody::parse(TEXT.as_bytes()).unwrap();
        let value: Value = serde_json::from_str(TEXT).unwrap();
        assert!(body.is_object());
        assert_eq!(body.messages().unwrap().to_value(), value["messages"]);
        assert_eq!(body.prompt().unwrap().to_value(), value["prompt"]);
        assert_eq!(body.value_of("model"), Some(json!("last")));
        assert_eq!(body.value_of("stream"), Some(json!(true)));
        assert_eq!(body.value_of("messages").as_ref(), Some(&value["messages"]));
        let from_value = RequestBody::from(&value);
        assert_eq!(from_value.messages().unwrap().to_value(), value["messages"]);
        assert_eq!(from_value.fields(), body.fields());
        // A duplicated member: the last value, as the Map keeps.
        let second = &body.messages().unwrap().as_array().unwrap()[1];
        assert_eq!(second.get("role").and_then(Json::as_str), Some("user"));
    }

    #[test]
    fn strings_without_escapes_borrow_from_the_body() {
        let body = RequestBody::parse(TEXT.as_bytes()).unwrap();
        let messages = body.messages().unwrap().as_array().unwrap();
        let content = |i: usize| match messages[i].get("content") {
            Some(Json::String(s)) => s.clone(),
            other => panic!("{other:?}"),
        };
        assert!(matches!(content(0), Cow::Borrowed("plain")));
        assert!(matches!(content(1), Cow::Owned(s) if s == "esc\"aped é"));
    }

    #[test]
    fn bad_json_fails_as_serde_json_does_and_other_json_parses() {
        for bad in [
            "{",
            "{\"a\": }",
            "[1,]",
            "",
            "{\"messages\": [\"\\x\"]}",
            "{\"messages\": [1e400]}",
        ] {
            let ours = RequestBody::parse(bad.as_bytes()).unwrap_err().to_string();
            let theirs = serde_json::from_str::<Value>(bad).unwrap_err().to_string();
            assert_eq!(ours, theirs, "{bad}");
        }
        // serde_json's nesting limit holds inside the prompt too.
        let deep = format!("{{\"messages\": {}{}}}", "[".repeat(200), "]".repeat(200));
        let err = RequestBody::parse(deep.as_bytes()).unwrap_err().to_string();
        assert!(err.contains("recursion limit"), "{err}");
        for other in ["[1, {\"a\": 2}]", "5", "\"s\"", "null", "true"] {
            let body = RequestBody::parse(other.as_bytes()).unwrap();
            assert!(!body.is_object(), "{other}");
        }
    }
}
