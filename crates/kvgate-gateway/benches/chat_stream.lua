-- wrk script: one small streaming chat completion per request.
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"model":"m","messages":[{"role":"user","content":"Say hello in one word."}],"max_tokens":4,"stream":true}'
