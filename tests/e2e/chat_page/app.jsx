// A chat page as an AI SDK user writes one: useChat with DefaultChatTransport pointed at
// koda. The test serves it on the gateway's origin at /chat-test/?chat=<id>&token=<token>.
// window.chat mirrors the hook's state (messages, status, error) for the test to read.
import React, { useEffect, useMemo, useState } from "react";
import { createRoot } from "react-dom/client";
import { useChat } from "@ai-sdk/react";
import { DefaultChatTransport } from "ai";

const params = new URLSearchParams(location.search);
const chatId = params.get("chat");
const headers = { Authorization: `Bearer ${params.get("token")}` };

function Part({ part }) {
  if (part.type === "text") return <span className="text">{part.text}</span>;
  if (part.type === "dynamic-tool" || part.type.startsWith("tool-")) {
    return (
      <div className="tool" data-state={part.state}>
        {part.toolName}({JSON.stringify(part.input)}) → {String(part.output ?? "")}
      </div>
    );
  }
  return null;
}

function Chat() {
  const [input, setInput] = useState("");
  const transport = useMemo(
    () =>
      new DefaultChatTransport({
        api: "/v1/chat",
        headers,
        // koda's session holds the conversation: send the new message only.
        prepareSendMessagesRequest: ({ id, messages }) => ({
          body: { id, message: messages[messages.length - 1] },
        }),
      }),
    [],
  );
  const { messages, sendMessage, status, stop, error } = useChat({
    id: chatId,
    resume: true,
    transport,
  });
  useEffect(() => {
    window.chat = { messages, status, error: error ? String(error.message) : null };
  });
  const stopAnswer = async () => {
    // stop() only aborts the fetch (a reload does that too): the run is cancelled here.
    const last = messages[messages.length - 1];
    const q = last && last.role === "assistant" ? `?message_id=${last.id}` : "";
    await fetch(`/v1/chat/${encodeURIComponent(chatId)}/stream${q}`, {
      method: "DELETE",
      headers,
    });
    await stop();
  };
  return (
    <div>
      <div id="messages">
        {messages.map((m) => (
          <div key={m.id} className={m.role} data-id={m.id}>
            {m.parts.map((p, i) => (
              <Part key={i} part={p} />
            ))}
          </div>
        ))}
      </div>
      <div id="status">{status}</div>
      <form
        onSubmit={(e) => {
          e.preventDefault();
          sendMessage({ text: input });
          setInput("");
        }}
      >
        <input id="message" value={input} onChange={(e) => setInput(e.target.value)} />
        <button id="send" type="submit">
          Send
        </button>
        <button id="stop" type="button" onClick={stopAnswer}>
          Stop
        </button>
      </form>
    </div>
  );
}

createRoot(document.getElementById("root")).render(<Chat />);
