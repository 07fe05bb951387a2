// Render the arithmatex spans ($...$ and $$...$$) with KaTeX when it is loaded.
document$.subscribe(({ body }) => {
  if (typeof renderMathInElement === "undefined") return;
  renderMathInElement(body, {
    delimiters: [
      { left: "$$", right: "$$", display: true },
      { left: "$", right: "$", display: false },
      { left: "\\(", right: "\\)", display: false },
      { left: "\\[", right: "\\]", display: true },
    ],
  });
});
