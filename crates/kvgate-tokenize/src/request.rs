//! Reading an OpenAI request body (parsed by `body.rs`) into what the tokenizer needs,
//! the way vLLM 0.32 does it (`vllm/entrypoints/chat_utils.py`, the tokenize protocol
//! models).
//!
//! Owns: the request shape decision (chat, single string prompt, single id list, or
//! nothing to route on), chat option defaults and validation, and the normalisation of
//! messages into the conversation the chat template sees (content parts joined with
//! "\n", non-text parts skipped and counted, tool-call arguments parsed, tools dumped
//! the way pydantic's `model_dump` does). Must not parse bytes, render templates or
//! encode text.

use serde_json::{Map, Value};

use crate::body::{Json, RequestBody};
use crate::{RequestKind, TokenizeError};

/// How the chat template expects `message.content`: vLLM's "string" or "openai" format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ContentFormat {
    /// Content is a plain string (text parts joined with "\n").
    String,
    /// Content is a list of `{"type": "text", "text": ...}` parts.
    OpenAi,
}

/// The routable shape of a request body.
pub(crate) enum Shape<'a> {
    Chat(&'a RequestBody<'a>),
    Text {
        prompt: &'a str,
        add_special_tokens: bool,
    },
    Ids(Vec<u32>),
    NoTokens(&'static str),
}

/// Decide what a body is, without touching the tokenizer.
pub(crate) fn classify<'a>(
    kind: RequestKind,
    body: &'a RequestBody<'a>,
) -> Result<Shape<'a>, TokenizeError> {
    if !body.is_object() {
        return Err(invalid("request body must be a JSON object"));
    }
    match kind {
        RequestKind::Chat => match body.messages() {
            None | Some(Json::Null) => Ok(Shape::NoTokens("no messages")),
            Some(Json::Array(_)) => Ok(Shape::Chat(body)),
            Some(_) => Err(invalid("'messages' must be an array")),
        },
        RequestKind::Completion => classify_prompt(body),
    }
}

fn classify_prompt<'a>(body: &'a RequestBody<'a>) -> Result<Shape<'a>, TokenizeError> {
    let obj = body.fields();
    let add_special_tokens = opt_bool(obj, "add_special_tokens")?.unwrap_or(true);
    let prompt = match body.prompt() {
        None | Some(Json::Null) => {
            let reason = if obj.get("prompt_embeds").is_some_and(|v| !v.is_null()) {
                "prompt_embeds"
            } else {
                "no prompt"
            };
            return Ok(Shape::NoTokens(reason));
        }
        Some(p) => p,
    };
    let is_number = |j: &Json| matches!(j, Json::Number(_));
    match prompt {
        Json::String(s) => Ok(Shape::Text {
            prompt: s,
            add_special_tokens,
        }),
        Json::Array(items) if items.is_empty() => Err(invalid("'prompt' must not be empty")),
        Json::Array(items) if items.iter().all(is_number) => Ok(Shape::Ids(token_ids(items)?)),
        Json::Array(items) if items.len() > 1 => {
            if items
                .iter()
                .all(|i| matches!(i, Json::String(_) | Json::Array(_)))
            {
                Ok(Shape::NoTokens("multiple prompts"))
            } else {
                Err(invalid(
                    "'prompt' must be a string, a list of token ids, or a list of prompts",
                ))
            }
        }
        Json::Array(items) => match &items[0] {
            Json::String(s) => Ok(Shape::Text {
                prompt: s,
                add_special_tokens,
            }),
            Json::Array(ids) if !ids.is_empty() => Ok(Shape::Ids(token_ids(ids)?)),
            _ => Err(invalid(
                "'prompt' must be a string, a list of token ids, or a list of prompts",
            )),
        },
        _ => Err(invalid(
            "'prompt' must be a string, a list of token ids, or a list of prompts",
        )),
    }
}

fn token_ids(items: &[Json]) -> Result<Vec<u32>, TokenizeError> {
    items
        .iter()
        .map(|v| {
            let id = match v {
                Json::Number(n) => n.as_u64(),
                _ => None,
            };
            id.and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| invalid(format!("invalid token id in 'prompt': {v}")))
        })
        .collect()
}

/// Chat options after vLLM's defaults and `chat_template_kwargs` overrides.
#[derive(Clone, Debug)]
pub(crate) struct ChatOptions {
    pub add_generation_prompt: bool,
    pub continue_final_message: bool,
    pub add_special_tokens: bool,
    /// Tool dicts as the template sees them (`None` when absent).
    pub tools: Option<Value>,
    pub documents: Option<Value>,
    /// Remaining `chat_template_kwargs`, passed into the template context.
    pub kwargs: Map<String, Value>,
}

impl ChatOptions {
    pub(crate) fn parse(obj: &Map<String, Value>) -> Result<ChatOptions, TokenizeError> {
        if obj.get("chat_template").is_some_and(|v| !v.is_null()) {
            return Err(invalid(
                "Chat template is passed with request, but --trust-request-chat-template \
                 is not set. Refused request with untrusted chat template.",
            ));
        }
        let body_agp = opt_bool(obj, "add_generation_prompt")?;
        let body_cfm = opt_bool(obj, "continue_final_message")?;
        if body_agp == Some(true) && body_cfm == Some(true) {
            return Err(invalid(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            ));
        }
        let add_special_tokens = opt_bool(obj, "add_special_tokens")?.unwrap_or(false);
        let tools = match obj.get("tools") {
            None | Some(Value::Null) => None,
            Some(Value::Array(tools)) => Some(Value::Array(
                tools.iter().map(dump_tool).collect::<Result<_, _>>()?,
            )),
            Some(_) => return Err(invalid("'tools' must be an array")),
        };
        let documents = obj.get("documents").filter(|v| !v.is_null()).cloned();
        let mut kwargs = match obj.get("chat_template_kwargs") {
            None | Some(Value::Null) => Map::new(),
            Some(Value::Object(m)) => m.clone(),
            Some(_) => return Err(invalid("'chat_template_kwargs' must be an object")),
        };
        let unexpected: Vec<&str> = ["chat_template", "tokenize", "messages", "conversation"]
            .into_iter()
            .filter(|k| kwargs.contains_key(*k))
            .collect();
        if !unexpected.is_empty() {
            return Err(invalid(format!(
                "Found unexpected chat template kwargs from request: {unexpected:?}"
            )));
        }
        // Request fields first, then chat_template_kwargs override them (vLLM merges
        // the kwargs dict over its own before calling apply_chat_template).
        let add_generation_prompt = match kwargs.remove("add_generation_prompt") {
            Some(v) => truthy(&v),
            None => body_agp.unwrap_or(true),
        };
        let continue_final_message = match kwargs.remove("continue_final_message") {
            Some(v) => truthy(&v),
            None => body_cfm.unwrap_or(false),
        };
        let tools = match kwargs.remove("tools") {
            Some(Value::Null) => None,
            Some(v) => Some(v),
            None => tools,
        };
        let documents = match kwargs.remove("documents") {
            Some(Value::Null) => None,
            Some(v) => Some(v),
            None => documents,
        };
        if add_generation_prompt && continue_final_message {
            return Err(invalid(
                "continue_final_message and add_generation_prompt are not compatible. Use \
                 continue_final_message when you want the model to continue the final \
                 message, and add_generation_prompt when you want to add a header that will \
                 prompt it to generate a new assistant message instead.",
            ));
        }
        Ok(ChatOptions {
            add_generation_prompt,
            continue_final_message,
            add_special_tokens,
            tools,
            documents,
            kwargs,
        })
    }
}

/// A `ChatCompletionToolsParam.model_dump()`: declared fields first (with `None` for
/// missing optional ones), then extra fields in request order.
fn dump_tool(tool: &Value) -> Result<Value, TokenizeError> {
    let obj = tool
        .as_object()
        .ok_or_else(|| invalid("each tool must be an object"))?;
    let ty = match obj.get("type") {
        None => "function",
        Some(Value::String(s)) if s == "function" => "function",
        Some(other) => return Err(invalid(format!("unsupported tool type: {other}"))),
    };
    let func = obj
        .get("function")
        .and_then(Value::as_object)
        .ok_or_else(|| invalid("each tool needs a 'function' object"))?;
    let name = func
        .get("name")
        .and_then(Value::as_str)
        .ok_or_else(|| invalid("each tool function needs a string 'name'"))?;
    let mut f = Map::new();
    f.insert("name".into(), Value::String(name.to_owned()));
    for key in ["description", "parameters"] {
        f.insert(key.into(), func.get(key).cloned().unwrap_or(Value::Null));
    }
    for (k, v) in func {
        if !f.contains_key(k) {
            f.insert(k.clone(), v.clone());
        }
    }
    let mut out = Map::new();
    out.insert("type".into(), Value::String(ty.to_owned()));
    out.insert("function".into(), Value::Object(f));
    for (k, v) in obj {
        if !out.contains_key(k) {
            out.insert(k.clone(), v.clone());
        }
    }
    Ok(Value::Object(out))
}

/// The conversation as the template sees it: built straight into the template engine's
/// values (each text copied once, from the request into the template's strings).
#[derive(Clone, Debug)]
pub(crate) struct Conversation {
    pub messages: Vec<minijinja::Value>,
    /// Non-text content parts skipped.
    pub non_text_parts: usize,
    /// Bytes of text in the conversation (to decide inline vs blocking-pool work).
    pub text_bytes: usize,
}

/// One message as the chat template sees it: a map of its fields, `role` and `content`
/// first, the others in the order vLLM adds them. One allocation, and a field lookup
/// is a comparison of names (a template reads several per message).
#[derive(Debug)]
struct Message {
    role: minijinja::Value,
    content: minijinja::Value,
    /// The fields some messages have (tool calls, reasoning, tool call id, name, ...).
    more: Vec<(&'static str, minijinja::Value)>,
}

impl minijinja::value::Object for Message {
    fn repr(self: &std::sync::Arc<Self>) -> minijinja::value::ObjectRepr {
        minijinja::value::ObjectRepr::Map
    }

    fn get_value(self: &std::sync::Arc<Self>, key: &minijinja::Value) -> Option<minijinja::Value> {
        match key.as_str()? {
            "role" => Some(self.role.clone()),
            "content" => Some(self.content.clone()),
            key => self
                .more
                .iter()
                .find(|(name, _)| *name == key)
                .map(|(_, v)| v.clone()),
        }
    }

    fn enumerate(self: &std::sync::Arc<Self>) -> minijinja::value::Enumerator {
        let keys = ["role", "content"]
            .into_iter()
            .chain(self.more.iter().map(|(name, _)| *name))
            .map(minijinja::Value::from)
            .collect::<Vec<_>>();
        minijinja::value::Enumerator::Values(keys)
    }
}

enum Part<'a> {
    Text(&'a str),
    /// `tool_reference`: text in the string format, a typed dict in the openai format.
    ToolReference(&'a str),
    NonText,
    Skip,
}

const MEDIA_TYPES: &[&str] = &[
    "input_image",
    "image_url",
    "image_embeds",
    "audio_embeds",
    "prompt_embeds",
    "image_pil",
    "audio_url",
    "input_audio",
    "video_url",
];

const TEXT_TYPES: &[&str] = &["text", "input_text", "output_text"];

fn parse_part<'a>(part: &'a Json<'_>) -> Result<Part<'a>, TokenizeError> {
    let obj = match part {
        Json::String(s) => return Ok(Part::Text(s)),
        Json::Object(_) => part,
        _ => return Err(invalid("content parts must be strings or objects")),
    };
    let field = |key: &str| match obj.get(key) {
        Some(Json::String(s)) => Ok(Part::Text(s)),
        None | Some(Json::Null) => Ok(Part::Skip),
        Some(_) => Err(invalid(format!(
            "content part field '{key}' must be a string"
        ))),
    };
    match obj.get("type") {
        Some(Json::String(ty)) => {
            let ty = ty.as_ref();
            if TEXT_TYPES.contains(&ty) {
                field("text")
            } else if ty == "refusal" {
                field("refusal")
            } else if ty == "thinking" {
                field("thinking")
            } else if ty == "tool_reference" {
                match field("name")? {
                    Part::Text(name) => Ok(Part::ToolReference(name)),
                    other => Ok(other),
                }
            } else if MEDIA_TYPES.contains(&ty) {
                Ok(Part::NonText)
            } else {
                let mut supported: Vec<&str> = TEXT_TYPES
                    .iter()
                    .chain(MEDIA_TYPES)
                    .chain(&["refusal", "thinking", "tool_reference"])
                    .copied()
                    .collect();
                supported.sort_unstable();
                Err(invalid(format!(
                    "Unsupported chat content part type: '{ty}'. Supported types: {}.",
                    supported.join(", ")
                )))
            }
        }
        None | Some(Json::Null) => {
            if MEDIA_TYPES
                .iter()
                .any(|k| obj.get(k).is_some_and(|v| !v.is_null()))
                || obj.get("image_url").is_some()
            {
                Ok(Part::NonText)
            } else if obj.get("tool_reference").is_some() {
                match obj.get("name") {
                    Some(Json::String(s)) => Ok(Part::ToolReference(s)),
                    _ => Ok(Part::Skip),
                }
            } else {
                Err(invalid("Missing 'type' field in multimodal part."))
            }
        }
        Some(_) => Err(invalid("Invalid 'type' field in multimodal part.")),
    }
}

/// Normalise `messages` into vLLM's `ConversationMessage` list.
pub(crate) fn conversation(
    body: &RequestBody<'_>,
    format: ContentFormat,
) -> Result<Conversation, TokenizeError> {
    use minijinja::Value as Jinja;
    let messages = body
        .messages()
        .and_then(Json::as_array)
        .ok_or_else(|| invalid("'messages' must be an array"))?;
    let mut out = Vec::with_capacity(messages.len());
    let mut non_text_parts = 0;
    let mut text_bytes = 0;
    for m in messages {
        if !m.is_object() {
            return Err(invalid("each message must be an object"));
        }
        let role = m
            .get("role")
            .and_then(Json::as_str)
            .ok_or_else(|| invalid("each message needs a string 'role'"))?;
        let parts: Vec<Part> = match m.get("content") {
            None | Some(Json::Null) => Vec::new(),
            Some(Json::String(s)) => vec![Part::Text(s)],
            Some(Json::Array(parts)) => parts.iter().map(parse_part).collect::<Result<_, _>>()?,
            Some(_) => {
                return Err(invalid(
                    "message 'content' must be a string, a list of parts, or null",
                ))
            }
        };
        let mut texts: Vec<&str> = Vec::with_capacity(parts.len());
        let mut wrapped: Vec<Jinja> = Vec::new();
        let mut skipped_here = 0;
        for part in parts {
            match part {
                Part::Text(t) => {
                    text_bytes += t.len();
                    if format == ContentFormat::OpenAi {
                        wrapped.push(Jinja::from_iter([("type", "text"), ("text", t)]));
                    }
                    texts.push(t);
                }
                Part::ToolReference(name) => {
                    text_bytes += name.len();
                    if format == ContentFormat::OpenAi {
                        wrapped.push(Jinja::from_iter([
                            ("type", "tool_reference"),
                            ("name", name),
                        ]));
                    }
                    texts.push(name);
                }
                Part::NonText => skipped_here += 1,
                Part::Skip => {}
            }
        }
        non_text_parts += skipped_here;
        let joined = || match texts.as_slice() {
            [one] => Jinja::from(*one),
            many => Jinja::from(many.join("\n")),
        };
        let content = match format {
            ContentFormat::String => joined(),
            // vLLM flattens an all-text tool message to a string in either format.
            ContentFormat::OpenAi if role == "tool" && skipped_here == 0 => joined(),
            ContentFormat::OpenAi => Jinja::from(wrapped),
        };
        let mut msg = Message {
            role: Jinja::from(role),
            content,
            more: Vec::new(),
        };
        if role == "assistant" {
            match m.get("tool_calls") {
                None | Some(Json::Null) => {}
                Some(Json::Array(calls)) if calls.is_empty() => {}
                Some(Json::Array(calls)) => {
                    let calls: Vec<Value> =
                        calls.iter().map(tool_call).collect::<Result<_, _>>()?;
                    msg.more.push(("tool_calls", Jinja::from_serialize(&calls)));
                }
                Some(_) => return Err(invalid("'tool_calls' must be an array")),
            }
            if let Some(r) = m.get("reasoning").filter(|v| !v.is_null()) {
                let r = Jinja::from_serialize(r.to_value());
                msg.more.push(("reasoning", r.clone()));
                msg.more.push(("reasoning_content", r));
            }
        } else if role == "tool" {
            if let Some(id) = m.get("tool_call_id") {
                msg.more
                    .push(("tool_call_id", Jinja::from_serialize(id.to_value())));
            }
        }
        for key in ["name", "task"] {
            if let Some(Json::String(v)) = m.get(key) {
                msg.more.push((key, Jinja::from(v.as_ref())));
            }
        }
        if role == "developer" {
            let tools = m.get("tools").map_or(Value::Null, Json::to_value);
            msg.more.push(("tools", Jinja::from_serialize(tools)));
        }
        out.push(Jinja::from_object(msg));
    }
    Ok(Conversation {
        messages: out,
        non_text_parts,
        text_bytes,
    })
}

/// Count non-text content parts without building the conversation (remote mode).
pub(crate) fn count_non_text(body: &RequestBody<'_>) -> Result<usize, TokenizeError> {
    let mut n = 0;
    for message in body
        .messages()
        .and_then(Json::as_array)
        .into_iter()
        .flatten()
    {
        if let Some(Json::Array(parts)) = message.get("content") {
            for part in parts {
                if matches!(parse_part(part)?, Part::NonText) {
                    n += 1;
                }
            }
        }
    }
    Ok(n)
}

/// vLLM's `_postprocess_messages`: tool-call arguments become JSON values.
fn tool_call(call: &Json) -> Result<Value, TokenizeError> {
    let mut call = call.to_value();
    let func = call
        .get_mut("function")
        .and_then(Value::as_object_mut)
        .ok_or_else(|| invalid("each tool call needs a 'function' object"))?;
    let parsed = match func.get("arguments") {
        Some(Value::String(s)) => {
            serde_json::from_str::<Value>(s).unwrap_or_else(|_| Value::Object(Map::new()))
        }
        Some(v @ (Value::Object(_) | Value::Array(_))) => v.clone(),
        _ => Value::Object(Map::new()),
    };
    func.insert("arguments".into(), parsed);
    Ok(call)
}

fn opt_bool(obj: &Map<String, Value>, key: &str) -> Result<Option<bool>, TokenizeError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(invalid(format!("'{key}' must be a boolean"))),
    }
}

/// Python truthiness of a JSON value (kwargs are passed to Python untyped).
fn truthy(v: &Value) -> bool {
    match v {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64().is_some_and(|f| f != 0.0),
        Value::String(s) => !s.is_empty(),
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
    }
}

pub(crate) fn invalid(msg: impl Into<String>) -> TokenizeError {
    TokenizeError::Invalid(msg.into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn prompt_shapes() {
        let c = |b: Value| match classify(RequestKind::Completion, &RequestBody::from(&b)) {
            Ok(Shape::Text {
                prompt,
                add_special_tokens,
            }) => format!("text:{prompt}:{add_special_tokens}"),
            Ok(Shape::Ids(ids)) => format!("ids:{ids:?}"),
            Ok(Shape::NoTokens(r)) => format!("none:{r}"),
            Ok(Shape::Chat(_)) => "chat".into(),
            Err(e) => format!("err:{e}"),
        };
        assert_eq!(c(json!({"prompt": "hi"})), "text:hi:true");
        assert_eq!(
            c(json!({"prompt": "hi", "add_special_tokens": false})),
            "text:hi:false"
        );
        assert_eq!(c(json!({"prompt": ["hi"]})), "text:hi:true");
        assert_eq!(c(json!({"prompt": [1, 2, 3]})), "ids:[1, 2, 3]");
        assert_eq!(c(json!({"prompt": [[4, 5]]})), "ids:[4, 5]");
        assert_eq!(c(json!({"prompt": ["a", "b"]})), "none:multiple prompts");
        assert_eq!(c(json!({"prompt": [[1], [2]]})), "none:multiple prompts");
        assert_eq!(c(json!({"model": "m"})), "none:no prompt");
        assert!(c(json!({"prompt": [-1]})).starts_with("err:"));
        assert!(c(json!({"prompt": 5})).starts_with("err:"));
        assert!(c(json!({"prompt": []})).starts_with("err:"));
        assert!(c(json!("x")).starts_with("err:"));
    }

    #[test]
    fn chat_without_messages_routes_without_tokens() {
        let b = json!({"model": "m"});
        assert!(matches!(
            classify(RequestKind::Chat, &RequestBody::from(&b)),
            Ok(Shape::NoTokens(_))
        ));
    }

    #[test]
    fn options_defaults_and_conflicts() {
        let o = |b: Value| ChatOptions::parse(b.as_object().unwrap());
        let d = o(json!({"messages": []})).unwrap();
        assert!(d.add_generation_prompt && !d.continue_final_message && !d.add_special_tokens);
        assert!(o(json!({"continue_final_message": true, "add_generation_prompt": true})).is_err());
        // The default add_generation_prompt=true also conflicts (HF's check).
        assert!(o(json!({"continue_final_message": true})).is_err());
        let k = o(json!({"chat_template_kwargs": {"add_generation_prompt": false, "enable_thinking": false}})).unwrap();
        assert!(!k.add_generation_prompt);
        assert_eq!(k.kwargs.get("enable_thinking"), Some(&json!(false)));
        assert!(o(json!({"chat_template": "{{ x }}"})).is_err());
        assert!(o(json!({"chat_template_kwargs": {"chat_template": "x"}})).is_err());
    }

    #[test]
    fn tools_are_dumped_like_pydantic() {
        let o = ChatOptions::parse(
            json!({"tools": [{"function": {"parameters": {"b": 1, "a": 2}, "name": "f", "strict": true}}]})
                .as_object()
                .unwrap(),
        )
        .unwrap();
        let dumped = serde_json::to_string(&o.tools.unwrap()).unwrap();
        assert_eq!(
            dumped,
            r#"[{"type":"function","function":{"name":"f","description":null,"parameters":{"b":1,"a":2},"strict":true}}]"#
        );
    }

    #[test]
    fn parts_join_and_skip_images() {
        let b = json!({"messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "a"},
                {"type": "image_url", "image_url": {"url": "http://x"}},
                "b",
                {"type": "text", "text": null}
            ]},
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}
            ], "reasoning": "hmm"}
        ]});
        let c = conversation(&RequestBody::from(&b), ContentFormat::String).unwrap();
        assert_eq!(c.non_text_parts, 1);
        let messages = serde_json::to_value(&c.messages).unwrap();
        assert_eq!(messages[0]["content"], json!("a\nb"));
        assert_eq!(messages[1]["content"], json!(""));
        assert_eq!(
            messages[1]["tool_calls"][0]["function"]["arguments"],
            json!({"x": 1})
        );
        assert_eq!(messages[1]["reasoning_content"], json!("hmm"));
        let o = conversation(&RequestBody::from(&b), ContentFormat::OpenAi).unwrap();
        let messages = serde_json::to_value(&o.messages).unwrap();
        assert_eq!(
            messages[0]["content"],
            json!([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}])
        );
        let bad = json!({"messages": [{"role": "user", "content": [{"type": "bogus"}]}]});
        assert!(conversation(&RequestBody::from(&bad), ContentFormat::String).is_err());
    }
}
